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
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,  # next power of two >= num_kv_heads
    BLOCK_D: tl.constexpr,  # next power of two >= head_dim
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

    k = tl.load(k_src, mask=mask)
    v = tl.load(v_src, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # int64 [T]; -1 = skip
) -> None:
    """Store key[t] / value[t] at cache slot slot_mapping[t]; slots of -1 are skipped."""
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
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
