"""The Triton kernels over grouped low-bit panels (kernels/triton_linear_qg.py) against a
float64 matmul of the weight the panels stand for, in every layout the CPU kernel takes
(the same bytes). Without CUDA under the Triton interpreter, set up by test_kernels_triton
(imported first)."""

import pytest
import torch
from test_kernels_triton import DEVICE, needs_cuda
from test_quant_groups import LAYOUTS, _weight

from kvray.kernels import cpu_groups, triton_linear_qg


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("m", [1, 3, 40])  # the split-K GEMV (<= 8 rows), the tiled matmul
def test_grouped_triton_linear_matches_a_float64_matmul(layout, m):
    n, k = 40, 96  # 3 panels (the last one partial), 3-6 groups
    codes, scales, mins = _weight(n, k, layout, seed=m)
    data = cpu_groups.to_panels(codes, scales, mins, layout)
    w = cpu_groups.dequantized(data, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(n)
    out = triton_linear_qg.grouped_linear(x.to(DEVICE), data.to(DEVICE), n, bias.to(DEVICE)).cpu()
    want = x.double() @ w.double().T + bias.double()
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize(
    "dtype",
    [torch.float16, pytest.param(torch.bfloat16, marks=needs_cuda)],  # the interpreter's bf16 dot: raw bits
)
def test_grouped_triton_linear_in_half_precision(dtype):
    layout = cpu_groups.Layout(4, 32, True, 8)
    n, k, m = 48, 128, 20
    codes, scales, mins = _weight(n, k, layout)
    data = cpu_groups.to_panels(codes, scales, mins, layout)
    w = cpu_groups.dequantized(data, n, k)
    x = torch.randn(m, k).to(dtype)
    out = triton_linear_qg.grouped_linear(x.to(DEVICE), data.to(DEVICE), n).cpu()
    want = x.double() @ w.double().T
    assert out.dtype == dtype
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 2e-2


@pytest.mark.parametrize("layout", [cpu_groups.Layout(4, 128), cpu_groups.Layout(4, 128, True)], ids=str)
@pytest.mark.parametrize("m", [1, 20])
def test_grouped_triton_linear_takes_groups_of_128(layout, m):
    """int4's quantization_group_size=128 panels: the same kernels, a group a 128-wide tile"""
    n, k = 40, 256
    codes, scales, mins = _weight(n, k, layout, seed=m)
    data = cpu_groups.to_panels(codes, scales, mins, layout)
    w = cpu_groups.dequantized(data, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8))
    out = triton_linear_qg.grouped_linear(x.to(DEVICE), data.to(DEVICE), n).cpu()
    want = x.double() @ w.double().T
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 1e-5
