"""The Triton attention backend: the engine's attention on CUDA devices.

Per layer it makes two launches: `reshape_and_cache` stores the step's new K/V at
`meta.slot_mapping`, then `unified_attention` reads every sequence's context through its
block table (decode rows and prefill chunks in the same launch; the split-KV decode path
when the batch is decode-only and too small to fill the GPU). The host copies of the q
and context lengths in the metadata are handed to the launcher, so choosing the path
never waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvray.kernels.backend import AttentionBackend, AttentionMetadata, register_backend
from kvray.kernels.triton_attention import unified_attention
from kvray.kernels.triton_cache import reshape_and_cache


@dataclass
class _TritonPlan:
    max_seqlen_q: int  # longest q chunk of the step
    max_seqlen_k: int  # longest context of the step (new tokens included)


@register_backend("triton")
class TritonBackend(AttentionBackend):
    def prepare(self, meta: AttentionMetadata) -> None:
        meta.plan = _TritonPlan(
            max_seqlen_q=max(meta.query_lens, default=0),
            max_seqlen_k=max(meta.seq_lens_host, default=0),
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        k_scale: torch.Tensor | None = None,  # fp32 [num_blocks, block_size, Hkv]: 8-bit caches
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        plan = meta.plan if isinstance(meta.plan, _TritonPlan) else None
        out = torch.empty_like(q)
        unified_attention(
            q,
            k_cache,
            v_cache,
            out,
            meta.cu_seqlens_q,
            meta.seq_lens,
            meta.block_tables,
            scale,
            sliding_window,
            k_scale,
            v_scale,
            max_seqlen_q=plan.max_seqlen_q if plan else None,
            max_seqlen_k=plan.max_seqlen_k if plan else None,
        )
        return out
