"""Random paged-attention batches and a float64 reference, for the kernel and backend tests."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(q_lens, seq_lens, num_kv_heads, group, head_dim, block_size, dtype, seed=0, device=DEVICE):
    """Random q and paged K/V; each sequence's blocks are scattered over a permuted pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq) + 2  # padded columns, as the engine pads its tables
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tensors = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
    )
    return {name: t.to(device) for name, t in tensors.items()}


def attention_f64(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window):
    """Float64 causal attention, one sequence at a time, context read position by position."""
    q, k_cache, v_cache = q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu()
    cu, lens, tables = cu_seqlens_q.tolist(), seq_lens.tolist(), block_tables.cpu()
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    for i, ctx in enumerate(lens):
        lo, hi = cu[i], cu[i + 1]
        pos = torch.arange(ctx)
        blocks = tables[i, pos // block_size].long()
        keys = k_cache[blocks, pos % block_size].repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = v_cache[blocks, pos % block_size].repeat_interleave(group, dim=1)
        q_pos = torch.arange(ctx - (hi - lo), ctx)
        visible = pos[None, :] <= q_pos[:, None]
        if window is not None:
            visible &= pos[None, :] > q_pos[:, None] - window
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi], keys) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


def quantize_batch(batch: dict, name: str = "int8") -> dict:
    """The batch with its caches made 8-bit as the engine holds them (kv_quant.py): int8
    rows of codes and scale, seen through k_cache/v_cache (codes) and k_scale/v_scale."""
    from kvray.kernels.kv_quant import QUANTS, quantize, split_cache

    quant, out = QUANTS[name], dict(batch)
    for which in ("k", "v"):
        values = batch[f"{which}_cache"]
        storage = torch.zeros(
            (*values.shape[:-1], values.shape[-1] + 4), dtype=torch.int8, device=values.device
        )
        codes, scales = split_cache(storage, quant)
        codes[:], scales[:] = quantize(values, quant)
        out[f"{which}_cache"], out[f"{which}_scale"] = codes, scales
    return out


def dequantized(batch: dict) -> dict:
    """The batch's caches as values (for the float64 reference), scales dropped."""
    from kvray.kernels.kv_quant import dequantize

    out = {k: v for k, v in batch.items() if not k.endswith("_scale")}
    for which in ("k", "v"):
        out[f"{which}_cache"] = dequantize(batch[f"{which}_cache"], batch[f"{which}_scale"])
    return out
