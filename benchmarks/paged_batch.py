"""Random paged-attention batches and a float64 reference, for the GPU check.

Kept apart from `gpu_check.py` so the check reads as its sections; deliberately not the
torch backend or `kvray.kernels.reference` (the kernels are judged against an independent
float64 computation), and not imported from `tests/` (a GPU machine may run the check
from a checkout without the test suite on its path).

Layouts are the engine's (see kvray.kernels.backend)::

    q:                [T, Hq, D]      sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1]
    k_cache, v_cache: [num_blocks, block_size, Hkv, D]
    block_tables:     int32 [S, max_blocks]; blocks drawn from a random permutation, so
                      no sequence's context is contiguous in memory
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    cu_seqlens_q: torch.Tensor  # int32 [S+1]
    seq_lens: torch.Tensor  # int32 [S], context incl. the new tokens
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    q_lens: list[int]  # host copies, as the engine hands them to the launcher
    seq_lens_host: list[int]

    def args(self) -> tuple:
        """Positional arguments of `unified_attention` after `out`."""
        return self.cu_seqlens_q, self.seq_lens, self.block_tables

    def kv_bytes(self) -> int:
        """Bytes of K and V a kernel must read: every context position, every KV head."""
        per_pos = 2 * self.k_cache.shape[2] * self.k_cache.shape[3] * self.k_cache.element_size()
        return sum(self.seq_lens_host) * per_pos


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> PagedBatch:
    """Random q and K/V (drawn on `device`, so large caches cost no host transfer)."""
    gen = torch.Generator(device).manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    rand = dict(generator=gen, device=device, dtype=torch.float32)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return PagedBatch(
        q=torch.randn(cu[-1], num_kv_heads * group, head_dim, **rand).to(dtype),
        k_cache=torch.randn(shape, **rand).to(dtype),
        v_cache=torch.randn(shape, **rand).to(dtype),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables,
        q_lens=list(q_lens),
        seq_lens_host=list(seq_lens),
    )


def gather_context(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, Hkv, D]: one sequence's K or V, read position by position through its table."""
    pos = torch.arange(seq_len, device=cache.device)
    return cache[table[pos // cache.shape[1]].long(), pos % cache.shape[1]]


def attention_f64(batch: PagedBatch, scale: float, window: int | None) -> torch.Tensor:
    """Float64 causal attention on the batch's device, one sequence at a time: [T, Hq, D]."""
    group = batch.q.shape[1] // batch.k_cache.shape[2]
    out = torch.zeros(batch.q.shape, dtype=torch.float64, device=batch.q.device)
    cu = batch.cu_seqlens_q.tolist()
    for i, ctx in enumerate(batch.seq_lens_host):
        lo, hi = cu[i], cu[i + 1]
        if hi == lo:
            continue
        keys = gather_context(batch.k_cache, batch.block_tables[i], ctx).double()
        values = gather_context(batch.v_cache, batch.block_tables[i], ctx).double()
        keys = keys.repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        pos = torch.arange(ctx, device=out.device)
        q_pos = pos[ctx - (hi - lo) :]
        visible = pos[None, :] <= q_pos[:, None]
        if window is not None:
            visible &= pos[None, :] > q_pos[:, None] - window
        scores = torch.einsum("qhd,khd->hqk", batch.q[lo:hi].double(), keys) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


def contiguous_kv(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of equal-length sequences as dense [S, Hkv, L, D], the layout SDPA wants."""
    length = batch.seq_lens_host[0]
    assert all(n == length for n in batch.seq_lens_host), "contiguous_kv needs equal lengths"
    num_blocks = -(-length // batch.k_cache.shape[1])
    tables = batch.block_tables[:, :num_blocks].long()

    def dense(cache: torch.Tensor) -> torch.Tensor:
        seqs = cache[tables].flatten(1, 2)[:, :length]  # [S, L, Hkv, D]
        return seqs.transpose(1, 2).contiguous()

    return dense(batch.k_cache), dense(batch.v_cache)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|; NaN anywhere in `out` gives inf (unwritten rows fail)."""
    if torch.isnan(out).any():
        return float("inf")
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
