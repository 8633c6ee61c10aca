"""Quantized KV caches: 8-bit values with a scale per token and KV head.

`kv_cache_dtype` (vLLM's option) is "auto" (the model's dtype), "int8" (any device) or
"fp8_e4m3" (CUDA). A quantized cache stores each (token, KV head) row of head_dim
values as 8-bit codes followed by its fp32 scale, in the same int8 tensor::

    cache row of one token and head:  [ code_0 ... code_{D-1} | scale (4 bytes) ]
    value_i ~= code_i * scale,        scale = max_i |value_i| / QMAX   (127 or 448)

so a block is still one slice of one tensor: block tables, prefix caching, pinning and
the KV transfer (which moves blocks as raw bytes) work unchanged, and a pull moves the
codes and their scales together. `split_cache` gives the kernels their two strided views
(codes [..., D] and scales [...]). fp32 values cost 4 D bytes a row, int8 D + 4: with
SmolLM2's D = 64 a budget holds 3.76x the blocks.

Codes are rounded half away from zero, the same in torch and in the Triton kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvray.errors import InvalidArgumentError

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
SCALE_BYTES = 4  # one fp32 scale per (token, KV head) row


@dataclass(frozen=True)
class KVQuant:
    name: str  # "int8" | "fp8_e4m3"
    codes: torch.dtype  # what the row's first D bytes hold
    qmax: float  # the largest code magnitude

    def row_bytes(self, head_dim: int) -> int:
        return head_dim + SCALE_BYTES


QUANTS = {
    "int8": KVQuant("int8", torch.int8, 127.0),
    "fp8_e4m3": KVQuant("fp8_e4m3", torch.float8_e4m3fn, 448.0),
}


def resolve_kv_cache_dtype(name: str, device: torch.device) -> KVQuant | None:
    """The quantization of `kv_cache_dtype` (None: the model's dtype, unquantized)."""
    if name not in KV_CACHE_DTYPES:
        raise InvalidArgumentError("kv_cache_dtype", name, f"one of {KV_CACHE_DTYPES}")
    if name == "fp8_e4m3" and device.type != "cuda":
        raise InvalidArgumentError("kv_cache_dtype", name, "'auto' or 'int8' on a CPU (fp8_e4m3: CUDA only)")
    return QUANTS.get(name)


def quant_of(codes: torch.Tensor) -> KVQuant:
    """The quantization whose codes a cache view holds (by its dtype)."""
    for q in QUANTS.values():
        if q.codes == codes.dtype:
            return q
    raise InvalidArgumentError("k_cache", str(codes.dtype), "int8 or float8_e4m3fn codes with scales")


def split_cache(cache: torch.Tensor, quant: KVQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [..., D] in quant.codes, scales [...] fp32): strided views of a quantized
    cache tensor [..., D + 4] of int8; writing through them writes the cache."""
    head_dim = cache.shape[-1] - SCALE_BYTES
    codes = cache[..., :head_dim].view(quant.codes)
    scales = cache[..., head_dim:].view(torch.float32).squeeze(-1)
    return codes, scales


def quantize(x: torch.Tensor, quant: KVQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D], fp32 scales [...]): the scale of each row maps its
    largest magnitude to qmax; an all-zero row gets scale 0 and codes 0."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / quant.qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = x / safe[..., None]
    if quant.codes == torch.int8:
        y = torch.sign(y) * torch.floor(y.abs() + 0.5)
        y = y.clamp(-quant.qmax, quant.qmax)
    return y.to(quant.codes), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., D], scales [...] -> values [..., D] in `dtype`."""
    return (codes.float() * scales[..., None].float()).to(dtype)


def within_one_step(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether two encodings of the same values differ by at most one code step, as two
    correct quantizers may (a GPU's fp32 division can round a tie the other way): int8
    codes at most 1 apart; fp8 e4m3 at most one step of the format at the larger one's
    magnitude (3 mantissa bits: 2^(e - 3) in [2^e, 2^(e + 1)); 2^-9 below 2^-6)."""
    integer = want.dtype == torch.int8
    got, want = got.float(), want.float()
    if integer:
        return bool((got - want).abs().max() <= 1)
    larger = torch.maximum(got.abs(), want.abs())
    step = torch.where(larger >= 2.0**-6, torch.exp2(torch.floor(torch.log2(larger)) - 3), 2.0**-9)
    return bool(((got - want).abs() <= step).all())
