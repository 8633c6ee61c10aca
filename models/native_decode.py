"""A decode step through all of a Llama model's layers in one native call, on a CPU.

At one to a few dozen sequences a decode step's layers do little work each, and running
them as ~15 torch ops and native calls per layer costs as much again in Python and
dispatch (BENCHMARKS.md, single stream). Where a step qualifies, `LlamaForCausalLM`
hands its layers to `kernels/cpu_layer.c` instead: one parallel region for every layer,
the same math and roundings as the modules (their norms, RoPE, matmul panels and decode
attention kernels).

A step qualifies when every row is a decode row (the torch attention backend's plan has
no prompt chunk), there are at most `NativePolicy.fused_rows` of them, and the model
qualifies: fp32 or bf16 on a CPU, no tensor parallelism, every linear in the native
panels, a KV cache in the model's dtype or int8 (`kv_cache_dtype="int8"`: the new K/V
quantized as kv_quant.quantize does it, bit for bit) with heads the decode kernel takes.
The engine config's `fused_decode=False` (or `KVRAY_FUSED_DECODE=0`) turns it off (the
modules then run as before).

The runner's decode steps go one further (`step`, by way of `LlamaForCausalLM.decode_step`,
one shard only): from the plan's token ids, positions, slots and block tables as Python
lists, the embedding's rows, the RoPE tables' rows, every layer, the final norm and the LM
head are one native call, without the attention metadata's tensors, the backend's plan,
the embedding and table lookups as torch ops (~0.15 ms of a one-row step's ~6.5 ms,
BENCHMARKS.md), nor the head's second parallel region and torch ops.
"""

from __future__ import annotations

import torch

from kvray.kernels import cpu_fused, cpu_native
from kvray.kernels.torch_backend import decode_only


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeDecode:
    """The model's layers as kernels/cpu_layer.c takes them (pointers into the model's own
    tensors and KV caches, which outlive it)."""

    def __init__(self, model, kv_caches):
        cfg, first = model.config, model.layers[0]
        attn = first.self_attn
        self.dtype = first.input_layernorm.weight.dtype
        self.most_rows = model.native_policy.fused_rows(self.dtype)  # rows of a step it takes
        self.shape = cpu_fused.DecodeShape(
            hidden=cfg.hidden_size,
            num_q_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            intermediate=len(first.mlp.down_proj.in_cols),
            block_size=kv_caches[0].k.shape[1],
            num_blocks=kv_caches[0].k.shape[0],
            kv_int8=kv_caches[0].k_scale is not None,
            eps=first.input_layernorm.eps,
            scale=attn.scale,
            weight_codes=cpu_native.weight_codes(attn.qkv_proj.panels),
        )
        self.layers = (cpu_fused.DecodeLayer * len(model.layers))()
        for entry, layer, kv in zip(self.layers, model.layers, kv_caches):
            a, mlp = layer.self_attn, layer.mlp
            entry.input_norm = _ptr(layer.input_layernorm.weight)
            entry.post_norm = _ptr(layer.post_attention_layernorm.weight)
            entry.qkv, entry.o = _ptr(a.qkv_proj.panels.data), _ptr(a.o_proj.panels.data)
            entry.gate_up, entry.down = _ptr(mlp.gate_up_proj.panels.data), _ptr(mlp.down_proj.panels.data)
            entry.qkv_bias, entry.o_bias = _ptr(a.qkv_proj.bias), _ptr(a.o_proj.bias)
            entry.gate_up_bias, entry.down_bias = _ptr(mlp.gate_up_proj.bias), _ptr(mlp.down_proj.bias)
            entry.k_cache, entry.v_cache = _ptr(kv.k), _ptr(kv.v)
            entry.window = a.sliding_window or 0

    @staticmethod
    def qualifies(model, kv_caches) -> bool:
        """Whether the model's layers and caches can run here (checked once per cache set)."""
        policy = getattr(model, "native_policy", None)  # (set when its weights were packed)
        if policy is None or not policy.fused_decode or model.shard.tp_size != 1 or not model.layers:
            return False
        if len(kv_caches) != len(model.layers):
            return False
        dtype = model.layers[0].input_layernorm.weight.dtype
        if not cpu_native.takes(dtype, model.layers[0].input_layernorm.weight.device):
            return False
        first = model.layers[0].self_attn.qkv_proj.panels
        weights = (
            first.data.dtype if first is not None and cpu_native.weight_codes(first) else dtype
        )  # all alike
        for layer, kv in zip(model.layers, kv_caches):
            a, mlp = layer.self_attn, layer.mlp
            linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(
                not isinstance(lin.panels, cpu_native.Panels) or lin.panels.data.dtype != weights
                for lin in linears
            ):
                return False
            biases = [lin.bias for lin in linears if lin.bias is not None]
            if any(b.dtype != dtype or not b.is_contiguous() for b in biases):
                return False
            if any(w.dtype != dtype for w in norms):
                return False
            if not _cache_qualifies(kv, dtype, unquantized=kv_caches[0].k_scale is None):
                return False
            if a.head_dim % 32 or a.num_heads % a.num_kv_heads or a.num_heads // a.num_kv_heads > 8:
                return False
        return True

    def run(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor | None:
        """The hidden states out of the last layer, or None where this step does not qualify."""
        rows = decode_only(meta)
        if rows is None or x.dtype != self.dtype or x.shape[0] > self.most_rows:
            return None
        cos, sin = rope
        if cos.dtype != torch.float32:
            return None
        return cpu_fused.decode_layers(
            self.layers,
            self.shape,
            x.contiguous(),
            cos.reshape(x.shape[0], -1),
            sin.reshape(x.shape[0], -1),
            meta.slot_mapping,
            rows.block_tables,
            rows.seq_lens,
            rows.rows,
        )

    def step(
        self, embed: torch.Tensor | cpu_native.Panels, rotary, plan, head
    ) -> cpu_fused.StepLogits | None:
        """A decode step from its tokens (`plan`: a StepPlan of one token a sequence): the
        embedding, RoPE tables, every layer and `head` (the final norm's weight, the LM
        head's panels) in one call: the fp32 logits and their argmax, or None where it does
        not qualify (the caller then runs the modules)."""
        if len(plan.input_ids) > self.most_rows:
            return None
        if isinstance(embed, cpu_native.Panels):  # an embedding held as grouped codes
            if cpu_native.weight_codes(embed) != 2:
                return None
        elif embed.dtype != self.dtype or not embed.is_contiguous():
            return None
        if not (rotary.cos.is_contiguous() and rotary.sin.is_contiguous()):
            return None
        return cpu_fused.decode_step(
            self.layers,
            self.shape,
            embed,
            (rotary.cos, rotary.sin),
            plan.input_ids,
            plan.positions,
            plan.slot_mapping,
            plan.block_tables,
            plan.seq_lens,
            head,
        )


def _cache_qualifies(kv, dtype: torch.dtype, unquantized: bool) -> bool:
    """A layer's caches: contiguous in the model's dtype, or int8 codes whose rows end in
    their scales (kv_quant.split_cache's views), alike in every layer."""
    if unquantized:
        return kv.k_scale is None and all(c.dtype == dtype and c.is_contiguous() for c in (kv.k, kv.v))
    return kv.k_scale is not None and all(
        codes.dtype == torch.int8 and cpu_native.rows_end_in_scales(codes, scales)
        for codes, scales in ((kv.k, kv.k_scale), (kv.v, kv.v_scale))
    )


def for_model(model, kv_caches: list) -> NativeDecode | None:
    """The model's NativeDecode for these caches (built once and kept), or None. The last
    call's list itself is taken as the same caches (the runner builds its list once):
    reading every layer's cache pointer each step cost ~20 us with the caches cold."""
    cached = getattr(model, "_native_decode", None)
    if cached is not None and cached[0] is kv_caches:
        return cached[2]
    key = tuple(kv.k.data_ptr() for kv in kv_caches)
    if cached is not None and cached[1] == key:
        native = cached[2]
    else:
        native = NativeDecode(model, kv_caches) if NativeDecode.qualifies(model, kv_caches) else None
    model._native_decode = (kv_caches, key, native)
    return native
