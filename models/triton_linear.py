"""Grouped low-bit codes (`quantization="int4"` and `"gguf"`) on GPUs: the panels the CPU
kernel reads (kernels/cpu_groups.py), moved to the device as they are and multiplied by
the Triton kernels over the same bytes (kernels/triton_linear_qg.py: a split-K GEMV for
decode steps, a tiled matmul for prompt chunks). The codes are built once on the CPU at
load (a GGUF's blocks repacked, or a checkpoint's weight quantized), a tensor at a time.

Where they run: on CUDA devices (`on_triton`). The embedding's rows stay in the dtype
there (a tied head's codes are de-quantized once for them): looking rows up in codes is
the CPU kernel's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvray.kernels import cpu_groups, cpu_native


def on_triton(device: torch.device) -> bool:
    """Whether grouped codes on `device` multiply through the Triton kernels (CUDA), not
    the native CPU ones."""
    return device.type == "cuda"


@dataclass
class TritonGrouped:
    """A weight [n, k] as grouped codes' panel bytes on the device."""

    data: torch.Tensor  # uint8: kernels/cpu_groups.py's header and panels
    n: int
    k: int

    @classmethod
    def of(cls, panels: cpu_native.Panels, device: torch.device) -> TritonGrouped:
        return cls(panels.data.to(device), panels.n, panels.k)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [n, k] the codes stand for, on the device."""
        return cpu_groups.dequantized(self.data.cpu(), self.n, self.k).to(self.data.device)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ b), x [..., k]; the result in x's dtype."""
        from kvray.kernels import triton_linear_qg  # imports Triton: only where it runs

        rows = x.reshape(-1, self.k).contiguous()
        out = triton_linear_qg.grouped_linear(rows, self.data, self.n, bias)
        return out.view(*x.shape[:-1], self.n)
