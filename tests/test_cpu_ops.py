"""The native CPU small ops (kernels/cpu_ops.c, kernels/cpu_linear.c) against float64
references written here: RMSNorm with and without the residual add, RoPE in place on the
q and k heads inside a fused qkv row (leaving the rest of the row untouched), and the
few-row linear. The layers take the native paths for fp32 CPU tensors and give what their
pure-torch (or oneDNN) paths give."""

from __future__ import annotations

import math

import pytest
import torch

from kvray.kernels import cpu_native
from kvray.models import cpu_linear
from kvray.models.layers import PackedLinear, RMSNorm, apply_rotary

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler: native ops not built")
TOL = 2e-6  # relative to the largest reference value (fp32 rounding of one pass)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _rms_f64(x, weight, eps):
    x = x.double()
    return weight.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("rows", [1, 7, 600])  # 600 x 576 takes the threaded path
def test_rms_norm_with_and_without_the_residual(rows):
    gen = torch.Generator().manual_seed(rows)
    x, res = (torch.randn(rows, 576, generator=gen) * 3 for _ in range(2))
    weight = torch.rand(576, generator=gen) + 0.5
    out, none = cpu_native.rms_norm(x, weight, 1e-5)
    assert none is None and _rel(out, _rms_f64(x, weight, 1e-5)) < TOL
    out, summed = cpu_native.rms_norm(x, weight, 1e-5, res)
    assert torch.equal(summed, x + res)  # the residual stream, exactly
    assert _rel(out, _rms_f64(x.double() + res.double(), weight, 1e-5)) < TOL


def test_rotary_in_place_on_the_q_heads_of_a_qkv_row():
    gen = torch.Generator().manual_seed(0)
    tokens, q_heads, kv_heads, d = 5, 9, 3, 64
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * d, generator=gen)
    before = qkv.clone()
    pos = torch.tensor([0, 3, 4, 100, 2047], dtype=torch.float64)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = pos[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]
    q = qkv[:, : q_heads * d].view(tokens, q_heads, d)
    out = apply_rotary(q, cos, sin)
    assert out.data_ptr() == q.data_ptr()  # in place
    x = before[:, : q_heads * d].view(tokens, q_heads, d).double()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    c, s = angles.cos()[:, None, :], angles.sin()[:, None, :]
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    assert _rel(q, want) < TOL
    assert torch.equal(qkv[:, q_heads * d :], before[:, q_heads * d :])  # k and v untouched
    assert math.isclose(q.norm().item(), x.norm().item(), rel_tol=1e-5)  # a rotation


def test_layers_give_what_their_torch_path_gives(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.rand(576, generator=gen) + 0.5
    x, res = torch.randn(4, 576, generator=gen), torch.randn(4, 576, generator=gen)
    native = norm(x), norm.add_and_norm(x, res)
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    torch_path = norm(x), norm.add_and_norm(x, res)
    torch.testing.assert_close(native[0], torch_path[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(native[1][0], torch_path[1][0], rtol=1e-6, atol=1e-6)
    assert torch.equal(native[1][1], torch_path[1][1])


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize(("n", "k"), [(37, 576), (960, 576), (130, 1536), (6, 16), (17, 3)])
def test_linear_against_float64(rows, n, k):
    """Every tile height (1-6 rows of x, several groups), a last panel of 1-16 columns, a
    bias, and rows of x that lie apart (a slice of wider rows)."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    wide = torch.randn(rows, k + 48, generator=gen)
    x = wide[:, 16 : 16 + k]
    weight, bias = torch.randn(n, k, generator=gen) / k**0.5, torch.randn(n, generator=gen)
    panels = cpu_native.to_panels(weight)
    assert cpu_native.takes_linear(x, panels)
    want = x.double() @ weight.double().T
    assert _rel(cpu_native.linear(x, panels, None), want) < 1e-5
    assert _rel(cpu_native.linear(x, panels, bias), want + bias.double()) < 1e-5


def test_packed_layer_uses_the_native_kernel_for_decode_rows_only(monkeypatch):
    if not cpu_linear.can_pack(torch.float32, torch.device("cpu")):
        pytest.skip("oneDNN cannot pack here")
    gen = torch.Generator().manual_seed(2)
    layer = PackedLinear(576, {"a": range(100), "b": range(60)})
    weight = layer.weight.data = torch.randn(160, 576, generator=gen)
    layer.pack_for_cpu()
    assert layer.weight is None and layer.packed is not None and layer.panels is not None
    calls = []
    real = cpu_native.linear
    monkeypatch.setattr(cpu_native, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, cpu_native.LINEAR_ROWS, cpu_native.LINEAR_ROWS + 1, 200):
        x = torch.randn(rows, 576, generator=gen)
        assert _rel(layer(x), x.double() @ weight.double().T) < 1e-5
    assert calls == [1, cpu_native.LINEAR_ROWS]  # wider steps go through oneDNN
