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

from kvray.kernels.backend import AttentionBackend, AttentionMetadata
from kvray.models.layers import PackedLinear, RMSNorm, RotaryEmbedding, apply_rotary, head_dim_of


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


class Attention(nn.Module):
    def __init__(self, config, sliding_window: int | None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.split = [q_size, kv_size, kv_size]

    def forward(self, x, rope, kv_cache, backend: AttentionBackend, meta):
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        size = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = PackedLinear(config.hidden_size, {"gate": size, "up": size}, bias)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, sliding_window: int | None):
        super().__init__()
        self.self_attn = Attention(config, sliding_window)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope, kv_cache, backend, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, backend, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Token ids in, last-position logits out; `kv_caches[i]` is layer i's (k_cache, v_cache)."""

    # HF parameter name fragment -> (our fragment, packed part)
    packed = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        windows = layer_sliding_windows(config)
        self.layers = nn.ModuleList(DecoderLayer(config, w) for w in windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # hidden states [T, hidden]
        x = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, backend, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] (pre-norm) -> fp32 logits [B, vocab]."""
        hidden = self.norm(hidden)
        weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters; returns the parameter names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            part = None
            for fragment, (ours, packed_part) in self.packed.items():
                if f".{fragment}." in name:
                    name, part = name.replace(fragment, ours), packed_part
                    break
            param = params[name]
            if part is None:
                param.data.copy_(tensor)
            else:
                param.weight_loader(param, tensor, part)
            loaded.add(name)
        return loaded
