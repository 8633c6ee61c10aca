"""`dtype="auto"`: the precision this device multiplies natively.

* CUDA: bfloat16, or float16 on a GPU without bf16 (before Ampere).
* CPU: bfloat16 only where the processor has bf16 instructions (x86: AVX512-BF16 or
  AMX-BF16; Arm: the BF16 extension), read from /proc/cpuinfo; elsewhere torch emulates
  bf16 matmuls at 25-60x the cost of fp32, so float32.
"""

from __future__ import annotations

import logging

import torch

from kvray.kernels.cpu_build import cpu_flags

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86 flags, Arm features


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    return bool((cpu_flags() if flags is None else flags) & NATIVE_BF16_FLAGS)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype of a config's `dtype` on `device` ("auto" chooses, and says why)."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        why = "the GPU's native half precision"
    elif device.type == "cpu" and cpu_has_native_bf16():
        dtype, why = torch.bfloat16, "the CPU multiplies bf16 natively (AVX512-BF16 / AMX / Arm BF16)"
    else:
        dtype, why = torch.float32, "the CPU has no bf16 instructions: bf16 would be emulated, 25-60x slower"
    logger.info("kvray: dtype auto -> %s (%s)", str(dtype).removeprefix("torch."), why)
    return dtype
