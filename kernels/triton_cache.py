"""Triton kernel that writes the step's new keys and values into the paged KV cache.

Layouts::

    key, value:       [T, Hkv, D]                         (last dim contiguous)
    k_cache, v_cache: [num_blocks, block_size, Hkv, D]    (last dim contiguous)

    slot_mapping[t] = block_id * block_size + offset_in_block
                      ┌──────── block b ────────┐
    k_cache[b, o] ◀── key[t]   where slot_mapping[t] == b * block_size + o
    slot_mapping[t] == -1: token t is not cached (padding); nothing is written.

One program copies one token: all of its KV heads as one [Hkv, D] tile, so a launch is
T programs whatever the head count. Values are cast to the cache dtype on store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvray.errors import InvalidArgumentError
from kvray.kernels.kv_quant import quant_of


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # int64 [T]
    stride_kt,  # key strides (token, head); the last dim is contiguous
    stride_kh,
    stride_vt,  # value strides (token, head)
    stride_vh,
    stride_cb,  # cache strides (block, offset, head), shared by k_cache and v_cache
    stride_co,
    stride_ch,
    k_scale_ptr,  # fp32 [num_blocks, block_size, Hkv] (QUANT only)
    v_scale_ptr,
    stride_sb,  # scale strides (block, offset, head), shared by both
    stride_so,
    stride_sh,
    num_kv_heads,
    head_dim,
    block_size,
    qmax,  # QUANT: the largest code magnitude (127 int8, 448 fp8 e4m3)
    BLOCK_H: tl.constexpr,  # next power of two >= num_kv_heads
    BLOCK_D: tl.constexpr,  # next power of two >= head_dim
    QUANT: tl.constexpr,  # store 8-bit codes and a scale per (token, head)
    ROUND: tl.constexpr,  # QUANT to integers: round half away from zero
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)

    k_src = key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    v_src = value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    dst = block * stride_cb + offset * stride_co + heads[:, None] * stride_ch + dims[None, :]

    k = tl.load(k_src, mask=mask, other=0.0)
    v = tl.load(v_src, mask=mask, other=0.0)
    if QUANT:
        at = block * stride_sb + offset * stride_so + heads * stride_sh
        k = _quantize(k, k_scale_ptr + at, heads < num_kv_heads, qmax, ROUND)
        v = _quantize(v, v_scale_ptr + at, heads < num_kv_heads, qmax, ROUND)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize(x, scale_ptr, head_ok, qmax, ROUND: tl.constexpr):
    """[BLOCK_H, BLOCK_D] values -> codes (still fp32); stores each head's scale."""
    x = x.to(tl.float32)
    scale = tl.max(tl.abs(x), axis=1) / qmax
    tl.store(scale_ptr, scale, mask=head_ok)
    y = x / tl.where(scale > 0, scale, 1.0)[:, None]
    if ROUND:
        y = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(-y + 0.5))
        y = tl.minimum(tl.maximum(y, -qmax), qmax)
    return y


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # int64 [T]; -1 = skip
    k_scale: torch.Tensor | None = None,  # fp32 [num_blocks, block_size, Hkv]: 8-bit caches
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store key[t] / value[t] at cache slot slot_mapping[t]; slots of -1 are skipped.
    With scales the caches hold 8-bit codes (int8 or float8_e4m3fn, kv_quant.py): each
    (token, head) row is stored as codes and its scale max|row| / qmax."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        allowed = f"the shape and strides of k_cache {tuple(k_cache.shape)}"
        raise InvalidArgumentError("v_cache", tuple(v_cache.shape), allowed)
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise InvalidArgumentError(
            "key", tuple(key.shape), f"[T, {k_cache.shape[2]}, {k_cache.shape[3]}] like value"
        )
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if k_cache.stride(-1) != 1:
        raise InvalidArgumentError("k_cache", "non-contiguous head_dim", "a contiguous last dim")

    quant = quant_of(k_cache) if k_scale is not None else None
    if quant is not None and (
        v_scale is None or k_scale.shape != k_cache.shape[:3] or v_scale.stride() != k_scale.stride()
    ):
        raise InvalidArgumentError(
            "k_scale", tuple(k_scale.shape), f"{tuple(k_cache.shape[:3])} like v_scale"
        )
    _reshape_and_cache_kernel[(num_tokens,)](
        key_ptr=key,
        value_ptr=value,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        slot_mapping_ptr=slot_mapping.to(torch.int64),
        stride_kt=key.stride(0),
        stride_kh=key.stride(1),
        stride_vt=value.stride(0),
        stride_vh=value.stride(1),
        stride_cb=k_cache.stride(0),
        stride_co=k_cache.stride(1),
        stride_ch=k_cache.stride(2),
        k_scale_ptr=k_scale if quant else k_cache,  # not read without QUANT
        v_scale_ptr=v_scale if quant else v_cache,
        stride_sb=k_scale.stride(0) if quant else 0,
        stride_so=k_scale.stride(1) if quant else 0,
        stride_sh=k_scale.stride(2) if quant else 0,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=k_cache.shape[1],
        qmax=quant.qmax if quant else 1.0,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=quant is not None,
        ROUND=quant is not None and quant.codes == torch.int8,
    )
