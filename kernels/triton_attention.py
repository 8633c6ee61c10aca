"""Triton paged attention over a packed batch that mixes decode rows and prefill chunks.

Layouts::

    q, out:           [T, Hq, D]  the T new tokens of S sequences, packed back to back
    k_cache, v_cache: [num_blocks, block_size, Hkv, D]
    cu_seqlens_q:     int32 [S+1]  sequence i owns q rows cu_seqlens_q[i]:cu_seqlens_q[i+1]
    seq_lens:         int32 [S]    context length of sequence i, new tokens included
    block_tables:     int32 [S, max_blocks]  context position p of sequence i lives at
                      block block_tables[i, p // block_size], offset p % block_size

    sequence i:  |<────────── seq_lens[i] context positions ──────────>|
                 | cached prefix (earlier steps)   | q_len new tokens  |
    q row r of i sits at position seq_lens[i] - q_len + r and sees keys j <= that position
    (and, with a sliding window W, j > position - W).

Plain path (any batch): one program per (q block, KV head). A q block is BLOCK_Q tokens
of one sequence times the GROUP = Hq // Hkv query heads sharing that KV head, i.e.
BLOCK_M = BLOCK_Q * GROUP rows, so each K/V tile is loaded once for the whole group.
Sequence i's q blocks are numbered from cu_seqlens_q[i] // BLOCK_Q + i; that needs no
host-side table, and T // BLOCK_Q + S programs per head cover every batch (programs past
their sequence's last token exit at once). The KV loop (`triton_attend.attend_tiles`) is
an online softmax (base 2) over tiles of TILE_N context positions, each position looked
up in the block table.

Split path (flash-decoding, decode-only batches, `triton_decode_split`): each sequence's
context is shared out over several programs whose partial results a reduce kernel
merges. `triton_decode_split.choose_num_splits` is the rule that picks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvray.errors import InvalidArgumentError
from kvray.kernels import triton_decode_split
from kvray.kernels.triton_attend import LOG2E, TILE_N, attend_tiles


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """Largest i with cu_seqlens_q[i] // BLOCK_Q + i <= q_block (binary search)."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        right = first <= q_block
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    out_ptr,  # [T, Hq, D]
    cu_seqlens_q_ptr,  # int32 [S+1]
    seq_lens_ptr,  # int32 [S]
    block_tables_ptr,  # int32 [S, max_blocks]
    qk_scale,
    window,
    num_seqs,
    head_dim,  # scale * log2(e); window or 0; S; real D
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,  # q / out strides (token, head)
    stride_cb,
    stride_co,
    stride_ch,
    k_scale_ptr,
    v_scale_ptr,
    stride_sb,
    stride_so,
    stride_sh,
    stride_bt,  # cache (block, offset, head); table row
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_tok = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_tok >= q_len:
        return
    prefix = tl.load(seq_lens_ptr + seq) - q_len  # context positions before the first q row

    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = tl.where(row_ok, prefix + tok, -1)
    dims = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (dims < head_dim)[None, :]
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=mask, other=0.0
    )

    key_hi = prefix + tl.minimum(first_tok + BLOCK_Q, q_len)
    key_lo = 0
    if HAS_WINDOW:
        key_lo = tl.maximum(prefix + first_tok - window + 1, 0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_bt,
        kv_head,
        key_lo,
        key_hi,
        qk_scale,
        window,
        head_dim,
        stride_cb,
        stride_co,
        stride_ch,
        k_scale_ptr,
        v_scale_ptr,
        stride_sb,
        stride_so,
        stride_sh,
        BLOCK_SIZE,
        TILE_N,
        BLOCK_D,
        HAS_WINDOW,
        DOT_PRECISION,
        QUANT,
    )
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def unified_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    out: torch.Tensor,  # [T, Hq, D], written in place
    cu_seqlens_q: torch.Tensor,  # int32 [S+1]
    seq_lens: torch.Tensor,  # int32 [S]
    block_tables: torch.Tensor,  # int32 [S, max_blocks]
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,  # fp32 [num_blocks, block_size, Hkv]: 8-bit caches
    v_scale: torch.Tensor | None = None,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    force_split: bool | None = None,
    num_splits: int | None = None,
) -> None:
    """Causal paged attention of every q row over its sequence's cached context.

    max_seqlen_q / max_seqlen_k: host copies of the longest q chunk and context, if the
        caller has them; otherwise they are read from the device when the split rule needs
        them (only for batches with as many q rows as sequences). max_seqlen_k must be
        >= seq_lens.max().
    force_split: None applies `choose_num_splits`; True takes the split-KV path (every
        q_len must be <= 1); False always takes the plain path.
    num_splits: the split count when the split path runs (None: the rule's, >= 2).
    k_scale / v_scale: an 8-bit cache's scales (int8 or float8_e4m3fn codes in k_cache /
        v_cache, kv_quant.py), dequantized as the tiles load.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_q_heads % num_kv_heads or k_cache.shape[3] != head_dim:
        allowed = f"[T, a multiple of {num_kv_heads}, {k_cache.shape[3]}]"
        raise InvalidArgumentError("q", tuple(q.shape), allowed)
    if v_cache.shape != k_cache.shape or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        allowed = f"{tuple(k_cache.shape)} like k_cache, last dims contiguous"
        raise InvalidArgumentError("v_cache", tuple(v_cache.shape), allowed)
    if out.shape != q.shape or out.stride(-1) != 1:
        allowed = f"{tuple(q.shape)}, last dim contiguous"
        raise InvalidArgumentError("out", tuple(out.shape), allowed)
    if sliding_window is not None and sliding_window < 1:
        raise InvalidArgumentError("sliding_window", sliding_window, "None or >= 1")
    if num_splits is not None and num_splits < 1:
        raise InvalidArgumentError("num_splits", num_splits, "None or >= 1")
    quant = k_scale is not None
    if quant and (
        v_scale is None or k_scale.shape != k_cache.shape[:3] or v_scale.stride() != k_scale.stride()
    ):
        raise InvalidArgumentError(
            "k_scale",
            None if k_scale is None else tuple(k_scale.shape),
            f"{tuple(k_cache.shape[:3])} with a v_scale of the same strides",
        )
    if num_tokens == 0 or num_seqs == 0:
        return
    q = q if q.stride(-1) == 1 else q.contiguous()
    cu_seqlens_q = cu_seqlens_q.to(torch.int32)
    seq_lens = seq_lens.to(torch.int32)
    block_tables = block_tables.to(torch.int32)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    group = num_q_heads // num_kv_heads
    common = dict(
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        cu_seqlens_q_ptr=cu_seqlens_q,
        seq_lens_ptr=seq_lens,
        block_tables_ptr=block_tables,
        qk_scale=scale * LOG2E,
        window=sliding_window or 0,
        head_dim=head_dim,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_cb=k_cache.stride(0),
        stride_co=k_cache.stride(1),
        stride_ch=k_cache.stride(2),
        k_scale_ptr=k_scale if quant else k_cache,  # not read without QUANT
        v_scale_ptr=v_scale if quant else v_cache,
        stride_sb=k_scale.stride(0) if quant else 0,
        stride_so=k_scale.stride(1) if quant else 0,
        stride_sh=k_scale.stride(2) if quant else 0,
        stride_bt=block_tables.stride(0),
        GROUP=group,
        BLOCK_SIZE=k_cache.shape[1],
        TILE_N=TILE_N,
        BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # no TF32 for fp32
        QUANT=quant,
    )

    # A batch with more q rows than sequences has a prefill chunk: no need to ask the device.
    if force_split or (force_split is None and num_tokens == num_seqs):
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        if max_seqlen_k is None:
            max_seqlen_k = int(seq_lens.max())
        if force_split and max_seqlen_q > 1:
            allowed = "only for batches whose every q_len is <= 1"
            raise InvalidArgumentError("force_split", force_split, allowed)
        visible = min(max_seqlen_k, sliding_window or max_seqlen_k)
        rule = triton_decode_split.choose_num_splits(
            num_seqs, num_kv_heads, max_seqlen_q, visible, triton_decode_split.num_sms(q.device)
        )
        if force_split or rule > 1:
            splits = num_splits or max(2, rule)
            triton_decode_split.split_decode(
                out, common, num_seqs, num_q_heads, num_kv_heads, splits, visible
            )
            return

    # Decode rows need few q rows per program; prefill chunks fill bigger tiles.
    decode_only = (max_seqlen_q or (2 if num_tokens > num_seqs else 1)) == 1
    block_m = max(16 if decode_only else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _unified_attention_kernel[grid](
        **common,
        out_ptr=out,
        num_seqs=num_seqs,
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
    )
