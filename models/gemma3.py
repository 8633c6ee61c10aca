"""Gemma 3 text decoder (`Gemma3ForCausalLM`) over the paged KV cache.

The Llama-family model with Gemma's differences, each a small module here:
- RMSNorm scales by (1 + weight), in fp32, before casting back (Llama casts, then scales);
- every layer norms both sides of its attention and of its MLP (four norms a layer);
- queries and keys are RMS-normed per head (q_norm, k_norm) before RoPE;
- the scores scale by `query_pre_attn_scalar ** -0.5`;
- the MLP is GeGLU (tanh-approximated GELU on the gate);
- the embedding is scaled by sqrt(hidden_size), rounded to the activations' dtype;
- local (sliding-window) layers and global layers have RoPE tables of their own
  (`rope_parameters["sliding_attention"]` and `["full_attention"]`, e.g. bases 1e4, 1e6).

Sliding-window layers keep their whole context in the paged cache: a block holds every
layer's K/V of its tokens, and the global layers (every sixth) still read blocks that
have left the local layers' window, so no block can be freed before the sequence ends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvray.errors import UnsupportedArchitectureError
from kvray.kernels.cpu_fused import StepLogits
from kvray.models.layers import RotaryEmbedding, apply_rotary
from kvray.models.llama import MLP, Attention, LlamaForCausalLM
from kvray.models.parallel import ShardContext


class GemmaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(Attention):
    def __init__(self, config, sliding_window: int | None, shard: ShardContext):
        super().__init__(config, sliding_window, shard)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, rope, kv_cache, backend, meta):
        qkv = self.qkv_proj(x)
        q_width, kv_width, _ = self.split
        q = self.q_norm(qkv[:, :q_width].reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(qkv[:, q_width : q_width + kv_width].reshape(-1, self.num_kv_heads, self.head_dim))
        q, k = apply_rotary(torch.cat((q, k), dim=1), *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, q_width + kv_width :].view(-1, self.num_kv_heads, self.head_dim)
        return self.attend(q, k, v, kv_cache, backend, meta)


class GemmaMLP(MLP):
    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, sliding_window: int | None, shard: ShardContext):
        super().__init__()
        self.is_sliding = sliding_window is not None
        self.self_attn = GemmaAttention(config, sliding_window, shard)
        self.mlp = GemmaMLP(config, shard)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x, ropes, kv_cache, backend, meta):
        attended = self.self_attn(self.input_layernorm(x), ropes[self.is_sliding], kv_cache, backend, meta)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def _rope_params(config) -> tuple[dict, dict]:
    """(global, local) RoPE parameters: transformers 5's per-layer-type entries, or a
    transformers 4 config's `rope_theta` (+ `rope_scaling`) and `rope_local_base_freq`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in params:
        return params["full_attention"], params.get("sliding_attention", params["full_attention"])
    full = {"rope_theta": getattr(config, "rope_theta", 1e6), **(getattr(config, "rope_scaling", None) or {})}
    return full, {"rope_theta": getattr(config, "rope_local_base_freq", 1e4), "rope_type": "default"}


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, config, max_positions: int, shard: ShardContext | None = None):
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedArchitectureError("hidden_activation", activation, "gelu_pytorch_tanh")
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise UnsupportedArchitectureError(
                "attn_logit_softcapping", config.attn_logit_softcapping, "None (Gemma 3 has none)"
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedArchitectureError("use_bidirectional_attention", True, "False (causal decoding)")
        super().__init__(config, max_positions, shard)
        full, local = _rope_params(config)
        self.rotary = RotaryEmbedding(config, max_positions, full)
        self.local_rotary = RotaryEmbedding(config, max_positions, local)
        self.embed_scale = config.hidden_size**0.5
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids, positions, kv_caches, backend, meta, hidden=None):
        if hidden is None:
            x = self.embed_tokens(input_ids)
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded as Hugging Face rounds it
        else:
            x = hidden
        ropes = {
            False: self.rotary.tables(positions, x.dtype),
            True: self.local_rotary.tables(positions, x.dtype),
        }
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, ropes, kv_cache, backend, meta)
        return x

    def decode_step(self, plan, kv_caches) -> StepLogits | None:
        return None  # the fused native step is Llama's layer; the modules run Gemma's

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap
