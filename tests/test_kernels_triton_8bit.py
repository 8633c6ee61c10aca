"""Triton kernels over 8-bit KV caches (int8, fp8 e4m3): the cache writes against
kv_quant.quantize, attention against float64 over the dequantized cache and against the
torch reference. Without CUDA under the Triton interpreter, set up by test_kernels_triton
(imported first), whose bounds and cases these share."""

import pytest
import torch
from attention_cases import attention_f64, dequantized, make_batch, quantize_batch
from test_kernels_triton import DEVICE, MIXED, REL_TOL, gpu, needs_cuda

from kvray.kernels import triton_attention, triton_cache
from kvray.kernels.kv_quant import QUANTS, quantize, split_cache, within_one_step
from kvray.kernels.reference import unified_attention_ref


@pytest.fixture
def fp8_rounding(monkeypatch):
    """Under the interpreter, fp32 -> fp8 e4m3 rounded as the GPU rounds it (to nearest
    even, torch's conversion): Triton 3.7's interpreter drops the carry into the exponent
    (124.03 -> 64), so without this the kernel's fp8 path could not be checked on a CPU."""
    if torch.cuda.is_available():
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    real = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.float8e4nv:
            values = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return real(data, src, dst, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


@pytest.mark.parametrize("num_kv_heads,head_dim,dtype", [(3, 64, torch.float32), (2, 80, torch.float16)])
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_reshape_and_cache_8bit_stores_codes_and_scales(num_kv_heads, head_dim, dtype, name, fp8_rounding):
    """Against kv_quant.quantize (torch): scales equal, codes within one step (a GPU's
    fp32 division may round a tie the other way); skipped slots untouched."""
    gen = torch.Generator().manual_seed(2)
    storage = torch.zeros(4, 16, num_kv_heads, head_dim + 4, dtype=torch.int8, device=DEVICE)
    (kc, ks), (vc, vs) = split_cache(storage, QUANTS[name]), split_cache(storage.clone(), QUANTS[name])
    key = (3 * torch.randn(9, num_kv_heads, head_dim, generator=gen)).to(dtype).to(DEVICE)
    value = torch.randn(9, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    key[4] = 0.0  # an all-zero row: scale 0, codes 0
    slots = torch.randperm(64, generator=gen)[:9]
    slots[6] = -1
    triton_cache.reshape_and_cache(key, value, kc, vc, slots.to(DEVICE), ks, vs)
    for x, codes, scales in ((key, kc, ks), (value, vc, vs)):
        want_codes, want_scales = quantize(x.cpu(), QUANTS[name])
        for t, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            b, o = divmod(slot, 16)
            torch.testing.assert_close(scales[b, o].cpu(), want_scales[t], rtol=1e-6, atol=0)
            assert within_one_step(codes[b, o].cpu(), want_codes[t])
        written = {s for s in slots.tolist() if s >= 0}
        untouched = [s for s in range(64) if s not in written]
        assert codes.reshape(64, -1)[untouched].view(torch.int8).count_nonzero() == 0


def attend(fn, batch, **kwargs) -> torch.Tensor:
    """fn (unified_attention or its torch reference) over an 8-bit batch (quantize_batch):
    scale 0.125, no window; returns the output."""
    out = torch.full_like(batch["q"], float("nan"))
    caches = [batch[name] for name in ("k_cache", "v_cache")]
    tables = [batch[name] for name in ("cu_seqlens_q", "seq_lens", "block_tables")]
    fn(batch["q"], *caches, out, *tables, 0.125, None, batch["k_scale"], batch["v_scale"], **kwargs)
    return out


def attend_8bit(batch, bound: float, **kwargs) -> torch.Tensor:
    """unified_attention over an 8-bit batch, checked against float64 attention over its
    dequantized cache; returns the output."""
    out = attend(triton_attention.unified_attention, batch, **kwargs)
    ref = attention_f64(**dequantized(batch), scale=0.125, window=None)
    rel = ((out.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert rel < bound, f"relative error {rel:.2e}"
    return out


@pytest.mark.parametrize(
    "q_lens,seq_lens,force_split",
    [(MIXED["q_lens"], MIXED["seq_lens"], False), ([1, 1, 1], [700, 33, 1200], True)],
    ids=["mixed", "split-decode"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_8bit_cache_attention_matches_float64_of_its_dequantized_values(
    q_lens, seq_lens, force_split, dtype, name
):
    """int8 and fp8 e4m3 codes (fp8: the GPU's format; its tile loads run here in the
    interpreter)."""
    batch = quantize_batch(make_batch(q_lens, seq_lens, 2, 4, 64, 16, dtype, seed=4), name)
    out = attend_8bit(batch, REL_TOL[dtype], force_split=force_split)
    expect = attend(unified_attention_ref, batch)  # the torch reference reads the same cache
    torch.testing.assert_close(
        out.float(), expect.float(), atol=5e-3 if dtype == torch.float16 else 1e-4, rtol=0
    )


@gpu
@needs_cuda
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_gpu_8bit_cache_attention(name):
    batch = quantize_batch(make_batch([1, 19, 1], [900, 50, 64], 2, 4, 128, 16, torch.bfloat16, seed=5), name)
    attend_8bit(batch, REL_TOL[torch.bfloat16])
