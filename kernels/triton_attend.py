"""The KV-tile loop shared by the plain and the split-KV attention kernels.

Both kernels hold a [BLOCK_M, BLOCK_D] block of query rows (the GROUP query heads that
share one KV head, times some tokens) and scan a range of context positions in tiles of
TILE_N, looking every position up in the sequence's block table::

    positions  key_lo ......................................... key_hi
    tiles      |<- TILE_N ->|<- TILE_N ->| ... |<- TILE_N ->|
    position p lives at k_cache[block_table[p // BLOCK_SIZE], p % BLOCK_SIZE, kv_head]

so any block size works and a tile may straddle blocks. An 8-bit cache (QUANT) is read
as codes and dequantized in the tile: each position's row times its scale (kv_quant.py).
The softmax is online, in base 2
(`qk_scale` already carries log2(e)): the caller owns the running state (acc, m_i, l_i)
and turns it into an output (the plain kernel) or a partial output plus its log-sum-exp
(the split kernel). It lives in its own module so both kernel modules can import it.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
TILE_N = 32  # context positions per KV tile (any block size works: positions are looked up)


@triton.jit
def attend_tiles(
    acc,
    m_i,
    l_i,  # [BLOCK_M, BLOCK_D], [BLOCK_M], [BLOCK_M] fp32 running softmax state
    q,  # [BLOCK_M, BLOCK_D] query rows (compute dtype)
    q_pos,  # [BLOCK_M] int32 absolute position of each row; -1 for padding rows
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_table_ptr,  # int32 [max_blocks]: this sequence's row of block_tables
    kv_head,
    key_lo,
    key_hi,  # scan context positions [key_lo, key_hi) of this KV head
    qk_scale,
    window,
    head_dim,  # scale * log2(e); sliding window (if HAS_WINDOW); real D
    stride_cb,
    stride_co,
    stride_ch,  # cache strides (block, offset, head)
    k_scale_ptr,
    v_scale_ptr,  # fp32 [num_blocks, block_size, Hkv] (QUANT only)
    stride_sb,
    stride_so,
    stride_sh,  # scale strides (block, offset, head)
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,  # 8-bit codes: values = codes * their row's scale
):
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    for start in range(key_lo, key_hi, TILE_N):
        k_pos = start + tl.arange(0, TILE_N)
        k_ok = k_pos < key_hi
        block = tl.load(block_table_ptr + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        base = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_co + kv_head * stride_ch
        k_t = tl.load(
            k_cache_ptr + base[None, :] + dims[:, None],  # [BLOCK_D, TILE_N]
            mask=dim_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if QUANT:
            at = block * stride_sb + (k_pos % BLOCK_SIZE) * stride_so + kv_head * stride_sh
            k_t = k_t.to(tl.float32) * tl.load(k_scale_ptr + at, mask=k_ok, other=0.0)[None, :]
        s = tl.dot(q, k_t.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))  # [BLOCK_M, TILE_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + base[:, None] + dims[None, :],  # [TILE_N, BLOCK_D]
            mask=k_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if QUANT:
            at = block * stride_sb + (k_pos % BLOCK_SIZE) * stride_so + kv_head * stride_sh
            v = v.to(tl.float32) * tl.load(v_scale_ptr + at, mask=k_ok, other=0.0)[:, None]
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i
