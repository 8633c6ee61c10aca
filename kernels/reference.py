"""Plain torch reference of the paged-attention kernels, same signatures as the Triton ones.

An 8-bit cache comes with its scales (`k_scale`, `v_scale`: one per token and KV head,
see kv_quant.py); the reference quantizes on write and dequantizes on read.

Runs on any device and is written for clarity: one sequence at a time, the context
gathered through the block table, a dense causal mask. The engine's CPU path uses the
batched `TorchBackend` (torch_backend.py), which computes the same thing faster.
"""

from __future__ import annotations

import torch

from kvray.kernels.kv_quant import quant_of, quantize


def reshape_and_cache_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T], -1 = skip
    k_scale: torch.Tensor | None = None,  # fp32 [num_blocks, block_size, Hkv]: 8-bit caches
    v_scale: torch.Tensor | None = None,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    pairs = ((key, k_cache, k_scale), (value, v_cache, v_scale))
    for x, cache, scales in pairs:
        flat = cache.view(-1, num_kv_heads, head_dim)
        if scales is None:
            flat[slots] = x[keep].to(cache.dtype)
        else:
            codes, row_scales = quantize(x[keep], quant_of(cache))
            flat[slots] = codes
            scales.view(-1, num_kv_heads)[slots] = row_scales


def context_mask(q_len: int, seq_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """Bool [q_len, seq_len]: True where query row i (position seq_len-q_len+i) sees key j."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, Hkv, D]: one sequence's cached K or V, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def unified_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, Hq, D], written in place
    cu_seqlens_q: torch.Tensor,  # int32 [S+1]
    seq_lens: torch.Tensor,  # int32 [S]
    block_tables: torch.Tensor,  # int32 [S, max_blocks]
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,  # fp32 [num_blocks, block_size, Hkv]: 8-bit caches
    v_scale: torch.Tensor | None = None,
) -> None:
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    starts = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        k = gather_context(k_cache, block_tables[i], seq_len).float()
        v = gather_context(v_cache, block_tables[i], seq_len).float()
        if k_scale is not None:
            k = k * gather_context(k_scale[..., None], block_tables[i], seq_len)
            v = v * gather_context(v_scale[..., None], block_tables[i], seq_len)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qi = q[lo:hi].float().transpose(0, 1)  # [Hq, q_len, D]
        scores = (qi @ k.transpose(1, 2)) * scale
        mask = context_mask(hi - lo, seq_len, sliding_window, q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        out[lo:hi] = (scores.softmax(-1) @ v).transpose(0, 1).to(out.dtype)
