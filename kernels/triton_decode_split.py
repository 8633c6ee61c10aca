"""Split-KV decode (flash-decoding): one decode row's context spread over several programs.

With few sequences the plain kernel runs num_seqs * Hkv programs, too few to fill the
GPU, each scanning a whole long context. Here each sequence's visible context is cut into
`splits` equal segments, one program per (sequence, KV head, split)::

    visible keys  |<- split 0 ->|<- split 1 ->| ... |<- split n-1 ->|
    program s     partial_out[s] = softmax-weighted V over its keys (normalised)
                  partial_lse[s] = log2 of its softmax denominator (-inf if it saw none)

then a reduce program per (sequence, query head) merges the partials with weights
exp2(lse_s - max lse). `choose_num_splits` is the rule that decides whether (and how
much) to split; `kvray.kernels.triton_attention.unified_attention` applies it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvray.kernels.triton_attend import TILE_N, attend_tiles

SPLIT_MIN_CONTEXT = 512  # below this many visible keys the plain path is fast enough
SPLIT_MIN_KEYS = 256  # each split gets at least this many keys
MAX_SPLITS = 32
ASSUMED_NUM_SMS = 132  # off-GPU (interpreter) stand-in for the SM count (H100/H200)


@triton.jit
def _split_decode_kernel(
    q_ptr,  # [T, Hq, D]; every sequence has q_len <= 1
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    partial_out_ptr,  # fp32 [S, Hq, num_splits, D]: split's output, already normalised
    partial_lse_ptr,  # fp32 [S, Hq, num_splits]: split's log2-sum-exp2 (-inf if empty)
    cu_seqlens_q_ptr,  # int32 [S+1]
    seq_lens_ptr,  # int32 [S]
    block_tables_ptr,  # int32 [S, max_blocks]
    qk_scale,
    window,
    head_dim,
    split_len,  # split_len: keys per split, multiple of TILE_N
    stride_qt,
    stride_qh,
    stride_cb,
    stride_co,
    stride_ch,
    k_scale_ptr,
    v_scale_ptr,
    stride_sb,
    stride_so,
    stride_sh,
    stride_bt,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_ls,
    stride_lh,  # partial_out (3), partial_lse (2)
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    if tl.load(cu_seqlens_q_ptr + seq + 1) == q_start:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_lo = 0
    if HAS_WINDOW:
        ctx_lo = tl.maximum(seq_len - window, 0)
    key_lo = ctx_lo + split * split_len
    key_hi = tl.minimum(key_lo + split_len, seq_len)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (dims < head_dim)[None, :]
    q = tl.load(
        q_ptr + q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=mask,
        other=0.0,
    )
    q_pos = tl.where(row_ok, seq_len - 1, -1)
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
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    part = seq * stride_ps + head * stride_ph + split * stride_pk
    tl.store(partial_out_ptr + part[:, None] + dims[None, :], acc / l_safe[:, None], mask=mask)
    tl.store(partial_lse_ptr + seq * stride_ls + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _split_reduce_kernel(
    partial_out_ptr,  # fp32 [S, Hq, num_splits, D]
    partial_lse_ptr,  # fp32 [S, Hq, num_splits]
    out_ptr,  # [T, Hq, D]
    cu_seqlens_q_ptr,  # int32 [S+1]
    num_splits,
    head_dim,
    stride_ps,
    stride_ph,
    stride_pk,
    stride_ls,
    stride_lh,  # partial_out (3), partial_lse (2)
    stride_ot,
    stride_oh,  # out strides (token, head)
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    if tl.load(cu_seqlens_q_ptr + seq + 1) == q_start:
        return
    splits = tl.arange(0, BLOCK_SPLITS)
    split_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    lse = tl.load(
        partial_lse_ptr + seq * stride_ls + head * stride_lh + splits, mask=split_ok, other=float("-inf")
    )
    weight = tl.exp2(lse - tl.max(lse, 0))  # [BLOCK_SPLITS]; empty splits weigh 0
    part = seq * stride_ps + head * stride_ph + splits[:, None] * stride_pk + dims[None, :]
    o = tl.load(partial_out_ptr + part, mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    o = tl.sum(weight[:, None] * o, 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + dims,
        o.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


@functools.lru_cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return ASSUMED_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seqlen_q: int, max_visible_keys: int, num_sms: int
) -> int:
    """Splits per sequence for the split-KV decode path; 1 means use the plain path.

    Split only when all of these hold:
    * the batch is decode-only (max_seqlen_q == 1);
    * the plain path would leave SMs idle: num_seqs * num_kv_heads < num_sms;
    * some sequence sees at least SPLIT_MIN_CONTEXT keys (window applied).
    Then aim at about two programs per SM, with at least SPLIT_MIN_KEYS keys per split
    and at most MAX_SPLITS splits: min(cdiv(2 * num_sms, num_seqs * num_kv_heads),
    max_visible_keys // SPLIT_MIN_KEYS, MAX_SPLITS).
    """
    programs = num_seqs * num_kv_heads
    if max_seqlen_q != 1 or programs >= num_sms or max_visible_keys < SPLIT_MIN_CONTEXT:
        return 1
    by_sms = triton.cdiv(2 * num_sms, programs)
    return max(1, min(by_sms, max_visible_keys // SPLIT_MIN_KEYS, MAX_SPLITS))


def split_decode(
    out: torch.Tensor,
    common: dict,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    splits: int,
    visible: int,
) -> None:
    """Flash-decoding: partial results per split, then a log-sum-exp merge into `out`.

    `common` holds the keyword arguments both attention kernels take (q, caches, metadata
    pointers, strides, GROUP/BLOCK_SIZE/TILE_N/BLOCK_D constexprs), already validated and
    built by `unified_attention`, the only caller.
    Scratch (fp32): partial_out [S, Hq, splits, D] and partial_lse [S, Hq, splits].
    Split s of sequence i covers visible keys [lo + s * split_len, lo + (s+1) * split_len),
    lo being the window's first key; split_len is a multiple of TILE_N.
    """
    head_dim = common["head_dim"]
    scratch = dict(dtype=torch.float32, device=out.device)
    partial_out = torch.empty(num_seqs, num_q_heads, splits, head_dim, **scratch)
    partial_lse = torch.empty(num_seqs, num_q_heads, splits, **scratch)
    split_len = triton.cdiv(triton.cdiv(visible, splits), TILE_N) * TILE_N
    strides = dict(
        stride_ps=partial_out.stride(0),
        stride_ph=partial_out.stride(1),
        stride_pk=partial_out.stride(2),
        stride_ls=partial_lse.stride(0),
        stride_lh=partial_lse.stride(1),
    )
    _split_decode_kernel[(num_seqs, num_kv_heads, splits)](
        **common,
        **strides,
        partial_out_ptr=partial_out,
        partial_lse_ptr=partial_lse,
        split_len=split_len,
        BLOCK_M=max(16, triton.next_power_of_2(common["GROUP"])),
    )
    _split_reduce_kernel[(num_seqs, num_q_heads)](
        **strides,
        partial_out_ptr=partial_out,
        partial_lse_ptr=partial_lse,
        out_ptr=out,
        cu_seqlens_q_ptr=common["cu_seqlens_q_ptr"],
        num_splits=splits,
        head_dim=head_dim,
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        BLOCK_SPLITS=triton.next_power_of_2(splits),
        BLOCK_D=common["BLOCK_D"],
    )
