"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over the paged KV cache.

Reads like single-device code: attention hands its new K/V and queries to the attention
backend, which writes the paged cache and reads the context back through block tables.
Per-architecture differences are config values: QKV bias (Qwen2), a sliding window
(Mistral, Qwen2 when enabled), RoPE scaling (Llama 3), tied embeddings (SmolLM).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvray.errors import InvalidArgumentError
from kvray.kernels import cpu_native
from kvray.kernels.backend import AttentionBackend, AttentionMetadata, LayerKV
from kvray.kernels.cpu_fused import StepLogits
from kvray.models import native_decode
from kvray.models.cpu_linear import linear, quantized_panels, weight_copies
from kvray.models.layers import (
    PackedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
    head_dim_of,
)
from kvray.models.parallel import ShardContext


def layer_sliding_windows(config) -> list[int | None]:
    """The attention window of each layer (None: full attention)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if getattr(config, "model_type", "") == "qwen2" and not getattr(config, "use_sliding_window", False):
        return [None] * n
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * n


# non-layer tensors that only some pipeline stages hold (first: embedding; last: norm, head)
OTHER_STAGE_TENSORS = frozenset({"embed_tokens.weight", "norm.weight", "lm_head.weight"})


class Attention(nn.Module):
    def __init__(self, config, sliding_window: int | None, shard: ShardContext):
        super().__init__()
        spec = shard.spec
        total_heads, total_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d = head_dim_of(config)
        q_heads, kv_heads = spec.q_heads(total_heads, total_kv), spec.kv_heads(total_heads, total_kv)
        self.num_heads, self.num_kv_heads = len(q_heads), len(kv_heads)
        self.scale = d**-0.5
        self.sliding_window = sliding_window
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        q_rows = range(q_heads.start * d, q_heads.stop * d)
        kv_rows = range(kv_heads.start * d, kv_heads.stop * d)
        self.qkv_proj = PackedLinear(config.hidden_size, {"q": q_rows, "k": kv_rows, "v": kv_rows}, bias)
        self.o_proj = RowParallelLinear(
            q_rows, config.hidden_size, getattr(config, "attention_bias", False), shard
        )
        self.split = [len(q_rows), len(kv_rows), len(kv_rows)]

    def forward(self, x, rope, kv_cache, backend: AttentionBackend, meta):
        qkv = self.qkv_proj(x)
        q_width, kv_width, _ = self.split
        # q's and k's heads side by side: one rotation (in place on a CPU) for both
        qk = qkv[:, : q_width + kv_width].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, q_width + kv_width :].view(-1, self.num_kv_heads, self.head_dim)
        return self.attend(q, k, v, kv_cache, backend, meta)

    def attend(self, q, k, v, kv_cache, backend: AttentionBackend, meta):
        """The rotated q, k and v through the backend (the paged cache) and o_proj."""
        o = backend.forward(
            q,
            k,
            v,
            kv_cache.k,
            kv_cache.v,
            meta,
            self.scale,
            self.sliding_window,
            kv_cache.k_scale,
            kv_cache.v_scale,
        )
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config, shard: ShardContext):
        super().__init__()
        cols = shard.spec.columns(config.intermediate_size)
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = PackedLinear(config.hidden_size, {"gate": cols, "up": cols}, bias)
        self.down_proj = RowParallelLinear(cols, config.hidden_size, bias, shard)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, sliding_window: int | None, shard: ShardContext):
        super().__init__()
        self.self_attn = Attention(config, sliding_window, shard)
        self.mlp = MLP(config, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope, kv_cache, backend, meta):
        attended = self.self_attn(self.input_layernorm(x), rope, kv_cache, backend, meta)
        h, x = self.post_attention_layernorm.add_and_norm(attended, x)
        return x + self.mlp(h)


class LlamaForCausalLM(nn.Module):
    """Token ids in, hidden states out; `kv_caches[i]` is local layer i's LayerKV.

    Under pipeline parallelism this module holds the stage's layers only (`layer_range`
    of the full model, still named `layers.0..`): the first stage embeds the tokens, a
    later one starts from the previous stage's hidden states, and only the last stage
    has the final norm and the LM head. Under tensor parallelism every layer holds its
    rank's heads and columns (see `kvray.models.parallel`).
    """

    # HF parameter name fragment -> (our fragment, packed part)
    packed = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    decoder_layer: type[nn.Module] = DecoderLayer  # a subclass's architecture swaps these
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config, max_positions: int, shard: ShardContext | None = None):
        super().__init__()
        self.config = config
        self.shard = shard = shard or ShardContext()
        spec = shard.spec
        self.layer_range = spec.layers(config.num_hidden_layers)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        vocab = spec.vocab(config.vocab_size)
        if spec.is_first_stage or (spec.is_last_stage and self.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(vocab, config.hidden_size, shard)
        windows = layer_sliding_windows(config)
        self.layers = nn.ModuleList(self.decoder_layer(config, windows[i], shard) for i in self.layer_range)
        self.rotary = RotaryEmbedding(config, max_positions)
        if spec.is_last_stage:
            self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
            if not self.tie_word_embeddings:
                self.lm_head = VocabParallelEmbedding(vocab, config.hidden_size, shard)
        self.packed_head: torch.Tensor | None = None  # the LM head in oneDNN's layout (CPU)
        self.panels_head: cpu_native.Panels | None = None  # ... and in the native kernel's

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: list[LayerKV],
        backend: AttentionBackend,
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,  # [T, hidden] from the previous stage
    ) -> torch.Tensor:  # hidden states [T, hidden]
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        rope = self.rotary.tables(positions, x.dtype)
        if x.device.type == "cpu":  # a decode step's layers in one native call, where it qualifies
            native = native_decode.for_model(self, kv_caches)
            # (it updates the residual stream in place: not the previous stage's tensor)
            out = None if native is None else native.run(x if hidden is None else x.clone(), rope, meta)
            if out is not None:
                return out
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, backend, meta)
        return x

    def decode_step(self, plan, kv_caches: list[LayerKV]) -> StepLogits | None:
        """A CPU decode step of one token a sequence (`plan`: the runner's StepPlan) from its
        token ids to its fp32 logits [T, vocab] and their argmax in one native call
        (native_decode: the embedding, every layer, then the final norm and the LM head as
        `compute_logits` runs them, the same bits), or None where the model or the step does
        not qualify: `forward` and `compute_logits` then run it."""
        native = native_decode.for_model(self, kv_caches)
        if native is None or not hasattr(self, "embed_tokens") or not hasattr(self, "norm"):
            return None
        head = self.panels_head  # None where the head's weight has no panels: the modules run
        if head is None or head.n != self.config.vocab_size:
            return None
        if not (
            head.data.dtype in (native.dtype, *cpu_native.QUANTIZED)
            and self.norm.weight.dtype == native.dtype
        ):
            return None
        embed = self.embed_tokens.weight if self.embed_tokens.weight is not None else self.embed_tokens.panels
        return native.step(embed, self.rotary, plan, (self.norm.weight, head))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] (pre-norm) -> fp32 logits [B, vocab] (last stage; every
        tensor rank of it takes part in the gather)."""
        hidden = self.norm(hidden)
        head = self.embed_tokens if self.tie_word_embeddings else self.lm_head
        logits = linear(hidden, head.weight, None, self.packed_head, self.panels_head)
        width = -(-self.config.vocab_size // self.shard.tp_size)
        return self.shard.all_gather_last(logits, width)[:, : self.config.vocab_size].float()

    def pack_for_cpu(
        self, quantization: str | None, policy: cpu_native.NativePolicy, group_size: int = 32
    ) -> None:
        """The LM head's packed copy (the embedding keeps its rows: a tied head shares them).
        Quantized: the head as panels of codes too (cpu_linear.quantized_panels; a step
        reads the whole head: for Qwen2.5-0.5B 43 % of its bytes; the shipped GGUF files
        hold it as Q8_0), while the embedding's rows stay in the dtype."""
        embed = getattr(self, "embed_tokens", None)
        if self.shard.spec.is_last_stage:
            head = self.embed_tokens if self.tie_word_embeddings else self.lm_head
            grouped = getattr(self, "grouped_head", None)
            panels = quantized_panels(head.weight, quantization, grouped, group_size)
            self.grouped_head = None
            if panels is not None:
                self.packed_head, self.panels_head = None, panels
                if quantization == "gguf" and self.tie_word_embeddings:
                    embed.hold_codes(panels)  # the file's rows, looked up in the head's codes
                elif not self.tie_word_embeddings:
                    head.weight = None  # the codes are the head's only copy
            else:
                self.packed_head, self.panels_head = weight_copies(head.weight, policy)
        grouped = getattr(self, "grouped_embed", None)
        if embed is not None and embed.weight is not None and grouped is not None:
            embed.hold_codes(quantized_panels(embed.weight, "gguf", grouped))  # its own codes
        self.grouped_embed = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (full, unsharded) into our parameters, each parameter
        taking its shard; tensors of other stages are skipped. Returns the names loaded.

        A tensor that no stage of this architecture has, or a parameter of this stage
        (or a part of a packed one) that no tensor filled, is an InvalidArgumentError
        naming them: never a model running on uninitialised memory."""
        params = dict(self.named_parameters())
        filled: set[tuple[str, str | None]] = set()
        unknown: list[str] = []
        for hf_name, tensor in weights:
            name = self._local_name(hf_name.removeprefix("model."))
            if name is None:
                if self._is_foreign(hf_name.removeprefix("model.")):
                    unknown.append(hf_name)
                continue
            part = None
            for fragment, (ours, packed_part) in self.packed.items():
                if f".{fragment}." in name:
                    name, part = name.replace(fragment, ours), packed_part
                    break
            param = params.get(name)
            if param is None:
                if name not in OTHER_STAGE_TENSORS:  # not merely another stage's
                    unknown.append(hf_name)
                continue
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor, part)
            filled.add((name, part))
        missing = sorted(self._hf_name(n, p) for n, p in self._wanted(params) - filled)
        if unknown or missing:
            raise InvalidArgumentError(
                "model",
                "<checkpoint>",
                "a checkpoint whose tensors are those of the architecture; "
                + "; ".join(
                    f"{what} {len(names)}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
                    for what, names in (("unknown", sorted(unknown)), ("missing", missing))
                    if names
                ),
            )
        return {n for n, _ in filled}

    def _wanted(self, params: dict) -> set[tuple[str, str | None]]:
        """(parameter, packed part) pairs that tensors must fill on this stage."""
        parts: dict[str, list[str]] = {}
        for ours, part in self.packed.values():
            parts.setdefault(ours, []).append(part)
        wanted = set()
        for name in params:
            if params[name].is_meta:  # held as codes (gguf_groups.attach): loads no tensor
                continue
            fragment = next((f for f in parts if f".{f}." in name), None)
            wanted |= {(name, p) for p in parts[fragment]} if fragment else {(name, None)}
        return wanted

    def _hf_name(self, name: str, part: str | None) -> str:
        """The checkpoint's name of our parameter `name` (its `part`, if packed)."""
        if part is not None:
            hf = next(f for f, (ours, p) in self.packed.items() if p == part and f".{ours}." in name)
            name = name.replace(next(o for o, p in self.packed.values() if p == part), hf)
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            name = f"layers.{int(index) + self.layer_range.start}.{rest}"
        return name if name == "lm_head.weight" else f"model.{name}"

    def needs(self, hf_name: str) -> bool:
        """Whether load_weights reads the tensor `hf_name` here: False only for another
        pipeline stage's (its layers, or an embedding, norm or head this stage lacks), which
        a loader need not even de-quantize."""
        name = hf_name.removeprefix("model.")
        if name.startswith("layers."):
            i = int(name.split(".", 2)[1])
            return i in self.layer_range or i >= self.config.num_hidden_layers
        if name in OTHER_STAGE_TENSORS:
            return hasattr(self, name.split(".")[0]) and not (
                name == "lm_head.weight" and self.tie_word_embeddings
            )
        return True

    def _is_foreign(self, name: str) -> bool:
        """A tensor `_local_name` skipped that no stage holds: a layer past the last."""
        if not name.startswith("layers."):
            return False
        return int(name.split(".", 2)[1]) >= self.config.num_hidden_layers

    def _local_name(self, name: str) -> str | None:
        """Our name for an HF tensor of this stage, or None when no stage needs it here."""
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            i = int(index)
            if i not in self.layer_range:
                return None
            return f"layers.{i - self.layer_range.start}.{rest}"
        return name
