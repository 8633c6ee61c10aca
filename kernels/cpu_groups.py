"""Weights as low-bit codes in groups along k, for kernels/cpu_linear_qg.c: each group of
`group` values (16, 32 or 128) of each output column has a scale and min, and stands for
code * scale + min (codes of 4, 5, 6 or 8 bits; `Layout`). `quantization="int4"` quantizes a checkpoint's
weights into it (`quantize_int4`); `"gguf"` repacks a GGUF file's blocks into it without
loss (models/gguf_groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WIDTH = 16  # output columns of a panel
HEADER = 64  # bytes before the panels: int32 bits, group, half, offset
BITS = (4, 5, 6, 8)
GROUPS = (16, 32, 128)  # the GGUF formats' 16 and 32; int4's 32 and 128


@dataclass(frozen=True)
class Layout:
    """How a panel's block holds a group: codes of `bits`, scales (and mins) in fp16 where
    `half` else fp32, and mins stored unless `offset` > 0 (each then -offset * scale)."""

    bits: int
    group: int
    half: bool = False
    offset: int = 0

    @property
    def code_bytes(self) -> int:
        return self.group * WIDTH * self.bits // 8

    @property
    def scale_bytes(self) -> int:  # one block's 16 scales (or mins)
        return WIDTH * (2 if self.half else 4)

    @property
    def block_bytes(self) -> int:
        return self.code_bytes + self.scale_bytes * (1 if self.offset else 2)


def _bit_planes(c: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., quads, 64] -> their bits 4.. as planes [..., bits - 4, quads * 8]: a
    little-endian 64-bit mask per quad, bit i of it code i's"""
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    planes = [((c >> b) & 1).view(*c.shape[:-1], 8, 8) * weights for b in range(4, bits)]
    planes = [p.sum(-1, dtype=torch.uint8).flatten(-2) for p in planes]
    return torch.stack(planes, dim=-2)


def to_panels(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The bytes of the panels for codes [n, k] (unsigned, below 2**bits), scales and mins
    [n, k / group] (kernels/cpu_linear_qg.c's layout). `half` needs scales and mins fp16
    holds exactly; `offset` mins equal to -offset * scales."""
    n, k = codes.shape
    bits, group = layout.bits, layout.group
    if bits not in BITS or group not in GROUPS or k % group:
        raise ValueError(
            f"grouped codes take bits in {BITS}, group in {GROUPS} dividing k; got {bits}, {group}, k={k}"
        )
    assert scales.shape == mins.shape == (n, k // group)
    if layout.half and not (exact_in_half(scales) and (layout.offset or exact_in_half(mins))):
        raise ValueError("half scales need scales (and stored mins) that fp16 holds exactly")
    if layout.offset and not torch.equal(mins.float(), scales.float() * -layout.offset):
        raise ValueError(f"offset {layout.offset} needs mins = -{layout.offset} * scales")
    panels, groups = -(-n // WIDTH), k // group

    def padded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(panels * WIDTH, t.shape[1], dtype=dtype)
        out[:n] = t
        return out

    c = padded(codes, torch.uint8).view(panels, WIDTH, groups, group // 4, 4)
    c = c.permute(0, 2, 3, 1, 4).reshape(panels, groups, group // 4, 64)  # [P, groups, quads, 64]
    if bits == 8:
        code_bytes = c.reshape(panels, groups, -1)
    else:
        pairs = (c & 15).reshape(panels, groups, group // 8, 2, 64)
        nibbles = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(panels, groups, -1)
        parts = [nibbles] + ([_bit_planes(c, bits).reshape(panels, groups, -1)] if bits > 4 else [])
        code_bytes = torch.cat(parts, dim=2)

    def columns(t: torch.Tensor) -> torch.Tensor:  # [n, groups] -> [P, groups, 16 values' bytes]
        dtype = torch.float16 if layout.half else torch.float32
        return (
            padded(t.float(), dtype)
            .view(panels, WIDTH, groups)
            .transpose(1, 2)
            .contiguous()
            .view(torch.uint8)
        )

    blocks = torch.cat([code_bytes, columns(scales)] + ([] if layout.offset else [columns(mins)]), dim=2)
    header = torch.zeros(HEADER, dtype=torch.uint8)
    fields = [bits, group, int(layout.half), layout.offset]
    header[:16] = torch.tensor(fields, dtype=torch.int32).view(torch.uint8)
    return torch.cat([header, blocks.reshape(-1)])


def exact_in_half(t: torch.Tensor) -> bool:
    """Whether fp16 holds every value of t exactly."""
    t = t.float()
    return bool(torch.equal(t.half().float(), t))


def layout(data: torch.Tensor) -> Layout:
    """The layout of panels' bytes (their header)."""
    bits, group, half, offset = data[:16].view(torch.int32).tolist()
    return Layout(bits, group, bool(half), offset)


def dequantized(data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The fp32 weight [n, k] the panels stand for (code x scale + min)."""
    lay = layout(data)
    bits, group = lay.bits, lay.group
    panels, groups = -(-n // WIDTH), k // group
    blocks = data[HEADER:].view(panels, groups, lay.block_bytes)
    c = blocks[:, :, : lay.code_bytes]
    if bits == 8:
        c = c.reshape(panels, groups, group // 4, 64)
    else:
        nib = c[:, :, : group * 8].reshape(panels, groups, group // 8, 1, 64)
        c_low = torch.cat([nib & 15, nib >> 4], dim=3).reshape(panels, groups, group // 4, 64)
        c = c_low.clone()
        planes = blocks[:, :, group * 8 : lay.code_bytes].reshape(panels, groups, bits - 4, group // 4, 8)
        for b in range(bits - 4):
            bit = (planes[:, :, b, :, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [.., quads, 8, 8]
            c |= bit.reshape(panels, groups, group // 4, 64) << (4 + b)
    c = c.reshape(panels, groups, group // 4, WIDTH, 4).permute(0, 3, 1, 2, 4).reshape(panels * WIDTH, k)

    def columns(start: int) -> torch.Tensor:
        dtype = torch.float16 if lay.half else torch.float32
        t = blocks[:, :, start : start + lay.scale_bytes].contiguous().view(dtype).float()  # [P, groups, 16]
        return t.transpose(1, 2).reshape(panels * WIDTH, groups)

    scales = columns(lay.code_bytes)
    mins = scales * -lay.offset if lay.offset else columns(lay.code_bytes + lay.scale_bytes)
    w = c.float().view(-1, groups, group) * scales[:, :, None] + mins[:, :, None]
    return w.view(-1, k)[:n]


def quantize_int4(weight: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantization="int4"`: each group of `group` values of a row to codes 0..15 between
    its min and max (asymmetric: scale = (max - min) / 15, the min its zero point), codes
    rounded to nearest; returns (codes [n, k] uint8, scales, mins [n, k / group])."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group, group)
    low, high = w.amin(dim=2), w.amax(dim=2)
    scales = (high - low) / 15
    inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    codes = torch.round((w - low[:, :, None]) * inverse[:, :, None]).clamp(0, 15).to(torch.uint8)
    return codes.view(n, k), scales, low


def quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] as the kernel quantizes it per group (d = max |x| / 127, codes rounded to
    nearest even): (codes [m, k] int8 as float, d [m, k / group]); tests' reference."""
    m, k = x.shape
    v = x.float().view(m, k // group, group)
    d = v.abs().amax(dim=2) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(v * inverse[:, :, None]).clamp(-127, 127)
    return codes.view(m, k), d
