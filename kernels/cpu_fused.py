"""The fused decode step's wrappers (kernels/cpu_layer.c, built and loaded with the other
native kernels: kernels/cpu_native.py): a step of decode rows through every layer in one
call, from the residual stream in (`decode_layers`, the modules' path) or from the token
ids to the logits (`decode_step`, the runner's path)."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from kvray.kernels.cpu_build import library
from kvray.kernels.cpu_native import DTYPES, Panels, dtype_suffix, weight_codes


class DecodeLayer(ctypes.Structure):
    """One layer's tensors for `decode_layers` (kernels/cpu_layer.c's DecodeLayer): data
    pointers in the model's dtype (biases NULL when absent), the cache's, its window."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "input_norm", "post_norm", "qkv", "o", "gate_up", "down",
            "qkv_bias", "o_bias", "gate_up_bias", "down_bias", "k_cache", "v_cache",
        )
    ] + [("window", ctypes.c_int32)]  # fmt: skip


class DecodeShape(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int32)
        for name in (
            "hidden", "num_q_heads", "num_kv_heads", "head_dim", "intermediate", "block_size", "kv_int8",
        )
    ] + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("weight_codes", ctypes.c_int32),
         ("embed_codes", ctypes.c_int32), ("num_blocks", ctypes.c_int32)]  # fmt: skip


class Head(ctypes.Structure):
    """The final norm and the LM head a decode step may end in (kernels/cpu_layer.c)."""

    _fields_ = [
        ("norm", ctypes.c_void_p), ("panels", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("logits", ctypes.c_void_p), ("argmax", ctypes.c_void_p),
        ("weight_codes", ctypes.c_int32),
    ]  # fmt: skip


class StepLogits(NamedTuple):
    """A decode step's fp32 logits [T, n] and each row's argmax of them [T] (int64)."""

    logits: torch.Tensor
    argmax: torch.Tensor


def decode_layers(
    layers: ctypes.Array,
    shape: DecodeShape,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """Every layer of a decode step in one call (kernels/cpu_layer.c): x [T, hidden]
    contiguous, the residual stream, updated in place and returned; cos, sin fp32
    [T, head_dim / 2]; slots int64 [T]; block_tables, seq_lens, rows as `paged_decode`
    takes them (every row of the step a decode row)."""
    assert x.is_contiguous() and x.dtype in DTYPES
    assert slots.dtype == rows.dtype == torch.int64
    assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == torch.float32
    assert block_tables.is_contiguous() and block_tables.dtype == seq_lens.dtype == torch.int32
    getattr(library(), f"kvray_decode_layers_{dtype_suffix(x.dtype)}")(
        ctypes.addressof(layers),
        len(layers),
        ctypes.addressof(shape),
        x.data_ptr(),
        x.shape[0],
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        rows.data_ptr(),
        len(rows),
        torch.get_num_threads(),
    )
    return x


def decode_step(
    layers: ctypes.Array,
    shape: DecodeShape,
    embed: torch.Tensor | Panels,
    rope: tuple[torch.Tensor, torch.Tensor],
    tokens: list[int],
    positions: list[int],
    slots: list[int],
    block_tables: list[list[int]],
    seq_lens: list[int],
    head: tuple[torch.Tensor, Panels],
) -> StepLogits | None:
    """A decode step from its tokens in one call (kernels/cpu_layer.c): the embedding's rows
    (embed [vocab, hidden], contiguous, the layers' dtype; or grouped codes' panels, the rows
    gathered from them), the RoPE tables' rows (fp32
    [max_positions, head_dim / 2] each), every layer, then `head` (the final norm's weight
    and the LM head's panels, the layers' dtype): the fp32 logits [T, n] (the head's output
    in the layers' dtype, widened) and each row's argmax, found while the logits were in the
    cores' caches; None where a token or a position is outside its table. One row a sequence
    (every row a decode row), block tables padded to one width; the step's plan built here
    from Python lists, no tensors."""
    rows = len(tokens)
    order = sorted(range(rows), key=seq_lens.__getitem__)  # ascending (kvray_decode_plan)
    width = len(block_tables[0])
    i32, i64 = ctypes.c_int32, ctypes.c_int64
    tables = (i32 * (rows * width))(*(b for r in order for b in block_tables[r]))
    lens = (i32 * rows)(*(seq_lens[r] for r in order))
    cos, sin = rope
    norm, panels = head
    dtype = norm.dtype  # the layers'
    x = torch.empty(rows, shape.hidden, dtype=dtype)  # the residual stream, scratch here
    codes = weight_codes(panels)  # the head's panels of codes (quantization=)
    assert (codes or panels.data.dtype == dtype) and norm.is_contiguous()
    shape.embed_codes = grouped = isinstance(embed, Panels)  # its rows gathered from grouped codes
    assert grouped or embed.dtype == dtype
    embed_at, vocab = (embed.data.data_ptr(), embed.n) if grouped else (embed.data_ptr(), embed.shape[0])
    assert panels.k == shape.hidden
    out = StepLogits(torch.empty(rows, panels.n, dtype=torch.float32), torch.empty(rows, dtype=torch.int64))
    ptrs = (out.logits.data_ptr(), out.argmax.data_ptr())
    ends = ctypes.byref(Head(norm.data_ptr(), panels.data.data_ptr(), panels.n, *ptrs, codes))
    status = getattr(library(), f"kvray_decode_step_{dtype_suffix(dtype)}")(
        ctypes.addressof(layers), len(layers), ctypes.addressof(shape), x.data_ptr(), rows,
        embed_at, vocab, (i64 * rows)(*tokens), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
        (i64 * rows)(*positions), (i64 * rows)(*slots), tables, width, lens, (i64 * rows)(*order), rows,
        torch.get_num_threads(), ends,
    )  # fmt: skip
    return out if status == 0 else None
