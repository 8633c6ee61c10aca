"""Native CPU kernels (kernels/cpu_decode.c: decode attention; kernels/cpu_prefill.c: prefill
attention; kernels/cpu_ops.c: RMSNorm with the residual add, RoPE, greedy argmax;
kernels/cpu_linear.c: the weight matmuls of steps of a few rows; kernels/cpu_layer.c: all
of a decode step's layers in one call, from those pieces, wrapped in kernels/cpu_fused.py),
built on first use with the machine's C compiler and loaded through ctypes
(kernels/cpu_build.py); here, their typed wrappers. The library links the OpenMP runtime
torch has already loaded, and takes torch's thread count per call. The call releases the
GIL (ctypes does), so the actor's event loop keeps running during a step.

Without a compiler, or with `KVRAY_NATIVE_KERNELS=0`, `library()` is None and the callers
(the torch attention backend, the model's layers) use their pure-torch paths; the reason
is logged once. `usable(x)` says whether a tensor can take the native path (fp32 or
bf16, CPU). Each kernel has an fp32 and a bf16 version (bf16 in and out, fp32 math; the
bf16 matmul panels use AVX512-BF16's `vdpbf16ps` where the CPU has it, portable C
elsewhere, so the tests run on any CPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvray.kernels.cpu_build import cpu_flags, library

# output columns of a panel (kernels/cpu_linear.c; int8 codes: cpu_linear_q8.c)
PANEL = {torch.float32: 16, torch.bfloat16: 32, torch.int8: 16, torch.uint8: 16}
QUANTIZED = (torch.int8, torch.uint8)  # panels of codes: int8 per channel, uint8 grouped (cpu_groups.py)


def weight_codes(panels: Panels) -> int:
    """The C kernels' code for the panels' weights: 0 the dtype, 1 int8, 2 grouped codes."""
    return {torch.int8: 1, torch.uint8: 2}.get(panels.data.dtype, 0)


DTYPES = (torch.float32, torch.bfloat16)  # what the kernels take


EVERY_STEP = 1 << 62  # panel rows that no step reaches
FUSED_ROWS = 64  # the most rows of a decode step run as one native call (models/native_decode.py)


@dataclass(frozen=True)
class NativePolicy:
    """Which of a model's steps go to the native kernels, fixed when its weights are
    packed (models/cpu_linear.pack_model; the engine builds it from its config, tests
    pass their own): steps of up to `panel_rows(dtype)` rows go through a layer's panels
    (wider ones through oneDNN), and with `fused_decode` a decode step of up to
    `fused_rows(dtype)` rows runs every layer in one call."""

    fp32_rows: int
    bf16_rows: int = 64
    fused_decode: bool = True

    def panel_rows(self, dtype: torch.dtype) -> int:
        return {torch.float32: self.fp32_rows, torch.bfloat16: self.bf16_rows}.get(dtype, 0)

    def fused_rows(self, dtype: torch.dtype) -> int:
        return min(self.panel_rows(dtype), FUSED_ROWS)

    def every_step(self, dtype: torch.dtype) -> bool:
        """Whether the panels take every step's rows: then a layer needs no other copy."""
        return self.panel_rows(dtype) >= EVERY_STEP


def machine_policy(fused_decode: bool = True) -> NativePolicy:
    """Up to how many rows the panels beat oneDNN's packed weights on this CPU. The fp32
    panels are AVX2-shaped (8-float vectors): where oneDNN has AVX-512 it wins from 4 rows
    on (Zen 5: 1-2 rows 9.6-11.0 ms against 11.7, 4 rows 11.4 against 11.0, for a step's
    30 layers); where it has not, the panels win at every row count measured, prompt
    chunks included (Zen 2, the model's four shapes, 64-512 rows: 178-198 GFLOP/s against
    oneDNN's 108-154; BENCHMARKS.md, offline). The bf16 panels beat it at 1-128 rows."""
    return NativePolicy(2 if "avx512f" in cpu_flags() else EVERY_STEP, 64, fused_decode)


def supports(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None = None) -> bool:
    """Whether `paged_decode` takes these: head_dim a multiple of 32, at most 8 query heads
    per KV head, unit-stride heads; fp32 or bf16 q with a contiguous cache of its dtype or
    int8 codes whose rows end in their scales (kv_quant.split_cache's views)."""
    head_dim, num_kv_heads = k_cache.shape[-1], k_cache.shape[-2]
    shape_ok = (
        head_dim % 32 == 0
        and q.shape[1] % num_kv_heads == 0
        and q.shape[1] // num_kv_heads <= 8
        and q.stride()[1:] == (head_dim, 1)
    )
    if k_scale is not None:
        int8_ok = q.dtype in DTYPES and k_cache.dtype == torch.int8
        return shape_ok and int8_ok and rows_end_in_scales(k_cache, k_scale)
    return shape_ok and q.dtype in DTYPES and k_cache.dtype == q.dtype and k_cache.is_contiguous()


def rows_end_in_scales(codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether int8 codes [blocks, block_size, Hkv, D] and their scales are
    kv_quant.split_cache's views of one contiguous cache (each row D codes, then its scale)."""
    num_blocks, block_size, num_kv_heads, head_dim = codes.shape
    row = head_dim + 4
    return (
        codes.stride() == (block_size * num_kv_heads * row, num_kv_heads * row, row, 1)
        and scales.data_ptr() == codes.data_ptr() + head_dim
    )


def paged_decode(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """out[rows] = attention of q[rows] (one token per sequence) over each sequence's
    paged context. q/out: [T, Hq, D] fp32 or bf16 with unit-stride heads; caches
    [num_blocks, block_size, Hkv, D] contiguous in q's dtype, or int8 codes with their
    scales (k_scale/v_scale, fp32 [num_blocks, block_size, Hkv]: the views of
    kv_quant.split_cache; the math is fp32: bf16 q rows are widened once, outputs rounded
    once);
    block_tables int32 [S, nb] contiguous; seq_lens int32 [S]; rows int64 [S]. Call only
    when `library()` is not None and `supports(q, k_cache, k_scale)`."""
    head_dim = k_cache.shape[-1]
    assert q.dtype == out.dtype and q.dtype in DTYPES and k_cache.dtype == v_cache.dtype
    assert q.stride()[1:] == out.stride()[1:] == (head_dim, 1) and block_tables.is_contiguous()
    assert block_tables.dtype == seq_lens.dtype == torch.int32 and rows.dtype == torch.int64
    if k_scale is None:
        assert k_cache.dtype == q.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
        kernel = getattr(library(), f"kvray_paged_decode_{dtype_suffix(q.dtype)}")
    else:
        assert rows_end_in_scales(k_cache, k_scale) and rows_end_in_scales(v_cache, v_scale)
        kernel = getattr(library(), "kvray_paged_decode_i8" + ("_bf16" if q.dtype == torch.bfloat16 else ""))
    _decode(kernel, q, out, k_cache, v_cache, block_tables, seq_lens, rows, scale, sliding_window)


def _decode(kernel, q, out, k_cache, v_cache, block_tables, seq_lens, rows, scale, sliding_window) -> None:
    """One call of a kvray_paged_decode_* kernel (the signature cpu_build declares)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    kernel(
        q.data_ptr(),
        q.stride(0),
        out.data_ptr(),
        out.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        rows.data_ptr(),
        len(rows),
        q.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        scale,
        sliding_window or 0,
        torch.get_num_threads(),
    )


def takes_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `prefill_attention` takes q [T, Hq, D], k and v [L, Hkv, D]: one dtype it
    runs, on the CPU, unit-stride heads, D a multiple of 64, Hq a multiple of Hkv."""
    head_dim, num_kv_heads = k.shape[-1], k.shape[-2]
    return (
        takes(q.dtype, q.device)
        and k.dtype == v.dtype == q.dtype
        and head_dim % 64 == 0
        and q.shape[1] % num_kv_heads == 0
        and q.stride()[1:] == (head_dim, 1)
        and k.stride()[1:] == v.stride()[1:] == (head_dim, 1)
        and k.stride(0) == v.stride(0)
    )


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal grouped-query attention of one sequence's chunk q [T, Hq, D] over its whole
    context k, v [L, Hkv, D] (query row i is position L - T + i): [T, Hq, D]. See
    `takes_prefill` for what it takes (kernels/cpu_prefill.c)."""
    q_len, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[0], k.shape[1]
    assert q_len <= kv_len and takes_prefill(q, k, v)
    out = torch.empty(q_len, num_q_heads, head_dim, dtype=q.dtype)
    getattr(library(), f"kvray_prefill_attention_{dtype_suffix(q.dtype)}")(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        out.data_ptr(),
        out.stride(0),
        q_len,
        kv_len,
        num_q_heads,
        num_kv_heads,
        head_dim,
        scale,
        torch.get_num_threads(),
    )
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for fp32 CPU rows [B, V] with unit-stride rows (`usable(x)`): int64 [B],
    the first index of each row's largest value (of its first NaN, if any)."""
    rows, n = x.shape
    assert x.dtype == torch.float32 and x.stride(1) == 1
    out = torch.empty(rows, dtype=torch.int64)
    library().kvray_argmax_f32(x.data_ptr(), x.stride(0), n, rows, out.data_ptr(), torch.get_num_threads())
    return out


def takes(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the native kernels run for tensors of this dtype on this device."""
    return dtype in DTYPES and device.type == "cpu" and library() is not None


def usable(x: torch.Tensor) -> bool:
    """Whether `x` can go through the native small-op kernels: an fp32 or bf16 CPU tensor
    with unit-stride rows, and the library built here."""
    return x.stride(-1) == 1 and takes(x.dtype, x.device)


def dtype_suffix(dtype: torch.dtype) -> str:
    """The kernels' name suffix for a dtype: `bf16` or `f32`."""
    return "bf16" if dtype == torch.bfloat16 else "f32"


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x / rms(x) * weight, None); with `residual`: (norm of s, s) for s = x + residual.
    x, residual: [rows, dim] with unit-stride rows; x, residual and weight of one dtype."""
    rows, dim = x.shape
    assert weight.dtype == x.dtype and weight.is_contiguous()
    assert residual is None or residual.dtype == x.dtype
    out = torch.empty(rows, dim, dtype=x.dtype)
    summed = None if residual is None else torch.empty(rows, dim, dtype=x.dtype)
    getattr(library(), f"kvray_rms_norm_{dtype_suffix(x.dtype)}")(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        None if summed is None else summed.data_ptr(),
        dim,
        out.data_ptr(),
        dim,
        weight.data_ptr(),
        rows,
        dim,
        eps,
        torch.get_num_threads(),
    )
    return out, summed


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (fp32 or bf16; heads unit-stride inside each row, any row stride)
    in place by the fp32 tables cos, sin (T x D/2 values each, contiguous); returns x."""
    rows, heads, head_dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == head_dim and cos.is_contiguous() and sin.is_contiguous()
    assert cos.numel() == sin.numel() == rows * head_dim // 2 and cos.dtype == sin.dtype == torch.float32
    getattr(library(), f"kvray_rotary_{dtype_suffix(x.dtype)}")(
        x.data_ptr(),
        x.stride(0),
        heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        rows,
        torch.get_num_threads(),
    )
    return x


class Panels(NamedTuple):
    """A linear's weight [n, k] in kernels/cpu_linear.c's layout: fp32 [ceil(n / 16), k, 16],
    bf16 [ceil(n / 32), k / 2, 32, 2]; int8 codes (`quantization="int8"`, kernels/
    cpu_linear_q8.c) [ceil(n / 16), 16 k + 64] bytes: each panel's codes [k][16], then its
    16 columns' fp32 scales; grouped low-bit codes (`"int4"`, `"gguf"`: kernels/cpu_groups.py)
    a uint8 buffer. `rows`: up to how many rows of a step the layers send to them
    (NativePolicy.panel_rows; codes, the weight's only copy, take any)."""

    data: torch.Tensor
    n: int
    k: int
    rows: int = EVERY_STEP


def to_panels(weight: torch.Tensor) -> Panels | None:
    """The weight [n, k] in panels of output columns, k-major (zero rows past n); None
    where the kernel cannot take it (another dtype; bf16 with an odd k)."""
    n, k = weight.shape
    dtype = weight.dtype
    if dtype not in DTYPES or (dtype == torch.bfloat16 and k % 2):
        return None
    width = PANEL[dtype]
    padded = torch.zeros(-(-n // width) * width, k, dtype=dtype)
    padded[:n] = weight.detach()
    if dtype == torch.float32:
        return Panels(padded.view(-1, width, k).transpose(1, 2).contiguous(), n, k)
    return Panels(padded.view(-1, width, k // 2, 2).transpose(1, 2).contiguous(), n, k)


def to_panels_int8(weight: torch.Tensor) -> Panels:
    """The weight [n, k] quantized per output channel (symmetric: scale = max |w| / 127,
    codes rounded half away from zero, as the 8-bit KV cache's) into int8 panels."""
    from kvray.kernels.kv_quant import QUANTS, quantize

    n, k = weight.shape
    width = PANEL[torch.int8]
    codes, scales = quantize(weight.detach(), QUANTS["int8"])
    panels = -(-n // width)
    padded = torch.zeros(panels * width, k, dtype=torch.int8)
    padded[:n] = codes
    padded_scales = torch.zeros(panels * width, dtype=torch.float32)
    padded_scales[:n] = scales
    data = torch.empty(panels, width * k + width * 4, dtype=torch.int8)
    data[:, : width * k] = padded.view(panels, width, k).transpose(1, 2).reshape(panels, width * k)
    data[:, width * k :] = padded_scales.view(panels, width).view(torch.int8)
    return Panels(data, n, k)


def dequantized(panels: Panels) -> torch.Tensor:
    """The fp32 weight [n, k] panels of codes stand for (int8: codes x scales)."""
    if panels.data.dtype == torch.uint8:
        from kvray.kernels import cpu_groups

        return cpu_groups.dequantized(panels.data, panels.n, panels.k)
    width, k = PANEL[torch.int8], panels.k
    codes = panels.data[:, : width * k].reshape(-1, k, width).transpose(1, 2).reshape(-1, k)
    scales = panels.data[:, width * k :].contiguous().view(torch.float32).reshape(-1)
    return (codes.float() * scales[:, None])[: panels.n]


@functools.cache
def integer_dots() -> bool:
    """Whether grouped codes' dot products run on the CPU's integer vector units
    (AVX512-VNNI; kernels/cpu_linear_qg.c), not its portable C."""
    lib = library()
    return lib is not None and bool(lib.kvray_linear_q_native())


def embedding_rows(panels: Panels, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the weight grouped codes' panels stand for, in `dtype` (fp32 or bf16):
    an embedding held as codes, looked up (the rows its de-quantized weight would give)."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= panels.n):
        raise IndexError(f"index out of range in self: ids in [0, {panels.n})")
    out = torch.empty(flat.numel(), panels.k, dtype=dtype)
    library().kvray_linear_q_rows(
        panels.data.data_ptr(), panels.n, panels.k, flat.data_ptr(), flat.numel(), out.data_ptr(),
        int(dtype == torch.bfloat16),
    )  # fmt: skip
    return out.view(*ids.shape, panels.k)


def takes_linear(x: torch.Tensor, panels: Panels | None) -> bool:
    """Whether `linear` takes x [rows, k]: at most `panels.rows` CPU rows of the panels'
    dtype and width (panels of codes: any rows of fp32 or bf16, they are the weight's only copy)."""
    codes = panels is not None and panels.data.dtype in QUANTIZED
    return (
        panels is not None
        and x.dim() == 2
        and (x.dtype == panels.data.dtype or codes and x.dtype in DTYPES)
        and (codes or x.shape[0] <= panels.rows)
        and x.shape[1] == panels.k
        and usable(x)
    )


def linear(x: torch.Tensor, panels: Panels, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) for a step's rows (a decode step's, or a prompt chunk's where the panels
    win there too); see `takes_linear`."""
    rows, k = x.shape
    assert bias is None or (bias.is_contiguous() and bias.dtype == x.dtype and bias.numel() == panels.n)
    out = torch.empty(rows, panels.n, dtype=x.dtype)
    weights = {torch.int8: "i8_", torch.uint8: "q_"}.get(panels.data.dtype, "")
    getattr(library(), f"kvray_linear_{weights}{dtype_suffix(x.dtype)}")(
        x.data_ptr(),
        x.stride(0),
        panels.data.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        panels.n,
        rows,
        panels.n,
        k,
        torch.get_num_threads(),
    )
    return out
