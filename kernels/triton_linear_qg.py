"""y = x W^T (+ b) on a GPU with W in the grouped low-bit panels the CPU kernel reads
(kernels/cpu_groups.py, kernels/cpu_linear_qg.c: codes of 4, 5, 6 or 8 bits in groups of
16, 32 or 128 along k, a scale and min per group and column, panels of 16 columns): the same
bytes, so a GGUF repacked once serves on either device.

Each program de-quantizes the tile of weights it needs in registers (code * scale + min,
in fp32, then the activations' dtype) and multiplies:
- `grouped_matmul`, prompt chunks: a [BLOCK_M, BLOCK_N] tile of out, one group of k a
  `tl.dot` (fp32 accumulators);
- `grouped_gemv`, decode steps of up to GEMV_ROWS rows: split-K, each program a
  BLOCK_N-column slice over a range of groups, atomically added into an fp32 out.
The activations stay in their dtype (no per-group quantization as on the CPU: a GPU's
tensor cores take bf16 at the rate they take int8 here, and weight bytes, not arithmetic,
bound these shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvray.kernels.cpu_groups import HEADER, layout

GEMV_ROWS = 8  # steps of up to this many rows take the split-K GEMV
_HEADER = tl.constexpr(HEADER)


@triton.jit
def _weight_tile(
    w8, w16, w32, cols, g, n, panel_bytes,
    BITS: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, OFFSET: tl.constexpr,
    CODE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, BLOCK_BYTES: tl.constexpr,
):  # fmt: skip
    """fp32 weights [BLOCK_N, GROUP] of columns `cols`, group `g` (zeros past n)"""
    c = cols % 16
    block = _HEADER + (cols // 16).to(tl.int64) * panel_bytes + g * BLOCK_BYTES  # [BLOCK_N]
    j = tl.arange(0, GROUP)
    live = (cols < n)[:, None]
    lane = 4 * c[:, None] + (j % 4)[None, :]  # the code's byte in its quad's 64-byte vector
    if BITS == 8:
        code = tl.load(w8 + block[:, None] + 64 * (j // 4)[None, :] + lane, mask=live, other=0).to(tl.int32)
    else:
        raw = tl.load(w8 + block[:, None] + 64 * (j // 8)[None, :] + lane, mask=live, other=0).to(tl.int32)
        code = (raw >> (4 * ((j // 4) % 2))[None, :]) & 15
        for b in tl.static_range(BITS - 4):  # the higher bits' planes: a 64-bit mask a quad
            at = block[:, None] + GROUP * 8 + b * GROUP * 2 + 8 * (j // 4)[None, :] + lane // 8
            plane = tl.load(w8 + at, mask=live, other=0).to(tl.int32)
            code = code | (((plane >> (lane % 8)) & 1) << (4 + b))
    at = block + CODE_BYTES  # the group's 16 scales, then (OFFSET == 0) its 16 mins
    if HALF:
        scale = tl.load(w16 + (at + 2 * c) // 2, mask=cols < n, other=0.0).to(tl.float32)
    else:
        scale = tl.load(w32 + (at + 4 * c) // 4, mask=cols < n, other=0.0)
    if OFFSET > 0:
        low = scale * -OFFSET
    elif HALF:
        low = tl.load(w16 + (at + SCALE_BYTES + 2 * c) // 2, mask=cols < n, other=0.0).to(tl.float32)
    else:
        low = tl.load(w32 + (at + SCALE_BYTES + 4 * c) // 4, mask=cols < n, other=0.0)
    return code.to(tl.float32) * scale[:, None] + low[:, None]


@triton.jit
def _matmul_kernel(
    x, w8, w16, w32, bias, out, m, n, groups, x_stride, out_stride, panel_bytes,
    BITS: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, OFFSET: tl.constexpr,
    CODE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    j = tl.arange(0, GROUP)
    for g in range(groups):
        xs = tl.load(
            x + rows[:, None].to(tl.int64) * x_stride + g * GROUP + j[None, :],
            mask=(rows < m)[:, None],
            other=0.0,
        )
        w = _weight_tile(w8, w16, w32, cols, g, n, panel_bytes, BITS, GROUP, HALF, OFFSET,
                         CODE_BYTES, SCALE_BYTES, BLOCK_BYTES)  # fmt: skip
        if IEEE:
            acc += tl.dot(xs, tl.trans(w.to(xs.dtype)), input_precision="ieee")
        else:
            acc += tl.dot(xs, tl.trans(w.to(xs.dtype)))
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    at = rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out + at, acc.to(out.dtype.element_ty), mask=(rows < m)[:, None] & (cols < n)[None, :])


@triton.jit
def _gemv_kernel(
    x, w8, w16, w32, out, m, n, groups, groups_per_split, x_stride, panel_bytes,
    BITS: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, OFFSET: tl.constexpr,
    CODE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.program_id(1) * groups_per_split
    j = tl.arange(0, GROUP)
    for r in tl.static_range(ROWS):
        if r < m:
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for g in range(first, tl.minimum(first + groups_per_split, groups)):
                w = _weight_tile(w8, w16, w32, cols, g, n, panel_bytes, BITS, GROUP, HALF, OFFSET,
                                 CODE_BYTES, SCALE_BYTES, BLOCK_BYTES)  # fmt: skip
                xs = tl.load(x + r * x_stride + g * GROUP + j).to(tl.float32)
                acc += tl.sum(w * xs[None, :], axis=1)
            tl.atomic_add(out + r * n + cols, acc, mask=cols < n)


def _meta(data: torch.Tensor, k: int) -> dict:
    lay = layout(data[:HEADER].cpu())
    groups = k // lay.group
    return dict(
        BITS=lay.bits, GROUP=lay.group, HALF=lay.half, OFFSET=lay.offset, CODE_BYTES=lay.code_bytes,
        SCALE_BYTES=lay.scale_bytes, BLOCK_BYTES=lay.block_bytes,
    ), groups, groups * lay.block_bytes  # fmt: skip


def _views(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """the panels' bytes as uint8, fp16 and fp32 (scales are 2- or 4-byte aligned)"""
    return data, data.view(torch.float16), data.view(torch.float32)


def grouped_linear(
    x: torch.Tensor, data: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [m, k] (fp32, fp16 or bf16, rows contiguous) times the weight [n, k] the panels'
    bytes `data` stand for, plus bias: [m, n] in x's dtype. Decode-sized steps take the
    split-K GEMV, others the tiled matmul."""
    m, k = x.shape
    meta, groups, panel_bytes = _meta(data, k)
    w8, w16, w32 = _views(data)
    if m <= GEMV_ROWS:
        block_n = 64
        splits = max(1, min(groups, 256 // max(1, triton.cdiv(n, block_n))))
        per = triton.cdiv(groups, splits)
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(n, block_n), triton.cdiv(groups, per))
        _gemv_kernel[grid](x, w8, w16, w32, out, m, n, groups, per, x.stride(0), panel_bytes, **meta,
                           BLOCK_N=block_n, ROWS=GEMV_ROWS)  # fmt: skip
        out = out if bias is None else out + bias.float()
        return out.to(x.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n = 32, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _matmul_kernel[grid](
        x, w8, w16, w32, bias if bias is not None else out, out, m, n, groups, x.stride(0), out.stride(0),
        panel_bytes, **meta, BLOCK_M=block_m, BLOCK_N=block_n, HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return out
