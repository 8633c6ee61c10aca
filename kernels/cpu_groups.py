"""Weights as low-bit codes in groups along k, for kernels/cpu_linear_qg.c: each group of
`group` values (16 or 32) of each output column has an fp32 scale and min, and stands for
code * scale + min (codes of 4 or 8 bits). `quantization="int4"` quantizes a checkpoint's
weights into it (`quantize_int4`); `"gguf"` repacks a GGUF file's blocks into it without
loss (models/gguf_groups.py).
"""

from __future__ import annotations

import torch

WIDTH = 16  # output columns of a panel
HEADER = 64  # bytes before the panels: int32 bits, int32 group
BITS = (4, 8)
GROUPS = (16, 32)


def block_bytes(bits: int, group: int) -> int:
    """A panel's bytes for one group: its codes, 16 fp32 scales, 16 fp32 mins."""
    return group * WIDTH * bits // 8 + 2 * WIDTH * 4


def to_panels(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, group: int
) -> torch.Tensor:
    """The bytes of the panels for codes [n, k] (unsigned, below 2**bits), scales and mins
    [n, k / group] (kernels/cpu_linear_qg.c's layout)."""
    n, k = codes.shape
    if bits not in BITS or group not in GROUPS or k % group:
        raise ValueError(
            f"grouped codes take bits in {BITS}, group in {GROUPS} dividing k; got {bits}, {group}, k={k}"
        )
    assert scales.shape == mins.shape == (n, k // group)
    panels, groups = -(-n // WIDTH), k // group

    def padded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(panels * WIDTH, t.shape[1], dtype=dtype)
        out[:n] = t
        return out

    c = padded(codes, torch.uint8).view(panels, WIDTH, groups, group // 4, 4)
    c = c.permute(0, 2, 3, 1, 4)  # [P, groups, quads, 16, 4]
    if bits == 4:
        c = c.reshape(panels, groups, group // 8, 2, WIDTH, 4)
        c = c[:, :, :, 0] | (c[:, :, :, 1] << 4)
    c = c.reshape(panels, groups, -1)

    def columns(t: torch.Tensor) -> torch.Tensor:  # [n, groups] fp32 -> [P, groups, 64] bytes
        return (
            padded(t.float(), torch.float32)
            .view(panels, WIDTH, groups)
            .transpose(1, 2)
            .contiguous()
            .view(torch.uint8)
        )

    blocks = torch.cat([c, columns(scales), columns(mins)], dim=2)
    header = torch.zeros(HEADER, dtype=torch.uint8)
    header[:8] = torch.tensor([bits, group], dtype=torch.int32).view(torch.uint8)
    return torch.cat([header, blocks.reshape(-1)])


def layout(data: torch.Tensor) -> tuple[int, int]:
    """(bits, group) of panels' bytes."""
    bits, group = data[:8].view(torch.int32).tolist()
    return bits, group


def dequantized(data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The fp32 weight [n, k] the panels stand for (code x scale + min)."""
    bits, group = layout(data)
    panels, groups = -(-n // WIDTH), k // group
    blocks = data[HEADER:].view(panels, groups, block_bytes(bits, group))
    code_bytes = group * WIDTH * bits // 8
    c = blocks[:, :, :code_bytes]
    if bits == 4:
        c = c.reshape(panels, groups, group // 8, 1, WIDTH, 4)
        c = torch.cat([c & 15, c >> 4], dim=3)
    c = c.reshape(panels, groups, group // 4, WIDTH, 4).permute(0, 3, 1, 2, 4).reshape(panels * WIDTH, k)

    def columns(start: int) -> torch.Tensor:
        t = blocks[:, :, start : start + WIDTH * 4].contiguous().view(torch.float32)  # [P, groups, 16]
        return t.transpose(1, 2).reshape(panels * WIDTH, groups)

    scales, mins = columns(code_bytes), columns(code_bytes + WIDTH * 4)
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
