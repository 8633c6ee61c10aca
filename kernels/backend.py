"""The attention-backend interface the model calls once per layer.

A backend owns how the new tokens' K/V are written into the paged cache and how
attention reads it back. The engine builds one `AttentionMetadata` per step; the
backend turns it into a `plan` once (`prepare`), and every layer reuses that plan, so
nothing that depends only on the batch is recomputed 30 times a step.

Paged cache layout (per layer)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale, v_scale: [num_blocks, block_size, num_kv_heads]   (8-bit caches only)
    slot = block_id * block_size + offset_in_block      (slot -1: skip)

Batch layout: the T scheduled tokens of S sequences are packed back to back; sequence
i owns q rows cu_seqlens_q[i]:cu_seqlens_q[i+1], which are the *last* q_len positions of
its context of seq_lens[i] tokens (cached prefix + new tokens). Attention is causal.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


class LayerKV(NamedTuple):
    """One layer's paged cache: K and V, and for an 8-bit cache their scales (kv_quant.py)."""

    k: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # fp32 [num_blocks, block_size, Hkv]
    v_scale: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Per-step description of the packed batch, shared by every layer."""

    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token
    cu_seqlens_q: torch.Tensor  # int32 [S+1]: q row offsets per sequence
    seq_lens: torch.Tensor  # int32 [S]: context length incl. the new tokens
    block_tables: torch.Tensor  # int32 [S, max_blocks]: block ids, padded with 0
    query_lens: list[int]  # host copy of the q lengths, for planning
    seq_lens_host: list[int]  # host copy of seq_lens
    block_size: int
    plan: Any = field(default=None)  # filled by AttentionBackend.prepare


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes attention over it."""

    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step before the forward; may fill `meta.plan`."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D] new keys (RoPE applied)
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        k_scale: torch.Tensor | None = None,  # fp32 [num_blocks, block_size, Hkv]: 8-bit caches
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store k/v at meta.slot_mapping (quantized where the cache has scales), then
        return attention output [T, Hq, D]."""


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(name: str):
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return wrap


def available_backends() -> list[str]:
    _import_builtin_backends()
    return sorted(_BACKENDS)


def get_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """`None` picks `triton` on CUDA and `torch` elsewhere."""
    from kvray.errors import InvalidArgumentError

    _import_builtin_backends()
    if name is None:
        name = "triton" if device.type == "cuda" and "triton" in _BACKENDS else "torch"
    if name not in _BACKENDS:
        raise InvalidArgumentError("attention_backend", name, f"one of {sorted(_BACKENDS)} or None")
    return _BACKENDS[name]()


def _import_builtin_backends() -> None:
    from kvray.kernels import torch_backend  # noqa: F401

    try:
        from kvray.kernels import triton_backend  # noqa: F401
    except ImportError:  # triton not installed: the torch backend still serves
        pass
