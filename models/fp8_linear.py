"""`quantization="fp8"` (vLLM's name): every linear's weight as float8 e4m3 codes with an
fp32 scale per output channel, the activations quantized to e4m3 per row (dynamic scales,
as vLLM's fp8 does for checkpoints without static ones), multiplied by
`torch._scaled_mm` (cuBLASLt's fp8 GEMM on Hopper and Ada GPUs; torch's reference on a
CPU, where it is slow but exact enough to test against). A weight takes a byte a value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def _codes(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """t (fp32) as e4m3 codes with a scale per slice along `dim` (max |t| / 448)."""
    scales = t.abs().amax(dim, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (t / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


@dataclass
class Fp8Weight:
    """A weight [n, k]: e4m3 codes and an fp32 scale per output channel, both padded to
    multiples of 16 (cuBLASLt's fp8 shapes; the padding's codes are zeros)."""

    data: torch.Tensor  # [n padded, k padded] float8_e4m3fn
    scales: torch.Tensor  # [1, n padded] fp32
    n: int
    k: int

    @classmethod
    def of(cls, weight: torch.Tensor) -> Fp8Weight:
        n, k = weight.shape
        codes, scales = _codes(weight.detach().float(), dim=1)
        padded = torch.zeros(-(-n // 16) * 16, -(-k // 16) * 16, dtype=FP8, device=weight.device)
        padded[:n, :k] = codes
        column_scales = torch.ones(1, padded.shape[0], device=weight.device)
        column_scales[0, :n] = scales[:, 0]
        return cls(padded, column_scales, n, k)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [n, k] the codes stand for."""
        return (self.data.float() * self.scales.T)[: self.n, : self.k]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ b), x [..., k] quantized per row; the result in x's dtype."""
        rows = x.reshape(-1, self.k).float()
        if self.data.shape[1] != self.k:
            rows = F.pad(rows, (0, self.data.shape[1] - self.k))
        codes, scales = _codes(rows, dim=1)
        out_dtype = torch.bfloat16 if x.is_cuda else torch.float32  # cuBLASLt's row-wise scaling: bf16
        out = torch._scaled_mm(codes, self.data.t(), scale_a=scales, scale_b=self.scales, out_dtype=out_dtype)
        out = out[:, : self.n].to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], self.n)
