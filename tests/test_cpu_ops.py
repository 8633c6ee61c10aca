"""The native CPU small ops (kernels/cpu_ops.c, kernels/cpu_linear.c) against float64
references written here: RMSNorm with and without the residual add, RoPE in place on the
q and k heads inside a fused qkv row (leaving the rest of the row untouched), and the
few-row linear. The layers take the native paths for fp32 CPU tensors and give what their
pure-torch (or oneDNN) paths give."""

from __future__ import annotations

import dataclasses
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


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64, 389])
@pytest.mark.parametrize(("n", "k"), [(37, 576), (960, 576), (130, 1536), (6, 16), (17, 3)])
def test_linear_against_float64(rows, n, k):
    """Every tile height (1-6 rows of x, several groups), a prompt chunk's rows, a last
    panel of 1-16 columns, a bias, and rows of x that lie apart (a slice of wider rows).
    (The kernel takes any row count; the panels' `rows` only says up to where the layers
    send rows to it.)"""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    wide = torch.randn(rows, k + 48, generator=gen)
    x = wide[:, 16 : 16 + k]
    weight, bias = torch.randn(n, k, generator=gen) / k**0.5, torch.randn(n, generator=gen)
    panels = cpu_native.to_panels(weight)
    assert cpu_native.takes_linear(x, panels) and cpu_native.takes_linear(x, panels._replace(rows=rows))
    assert not cpu_native.takes_linear(x, panels._replace(rows=rows - 1))
    want = x.double() @ weight.double().T
    assert _rel(cpu_native.linear(x, panels, None), want) < 1e-5
    assert _rel(cpu_native.linear(x, panels, bias), want + bias.double()) < 1e-5


@pytest.mark.parametrize("threads", [1, 3, 5])
def test_linear_shares_take_every_panel_once_at_any_thread_count(threads):
    """Each thread takes its own share of the panels, then what the others have left:
    with more threads than panels, or shares that do not divide them, every panel is
    computed once and the product is bitwise what one thread makes."""
    gen = torch.Generator().manual_seed(threads)
    before = torch.get_num_threads()
    for rows, n, k in ((7, 37, 576), (389, 130, 64), (1, 960, 576), (40, 16, 32)):
        x, weight = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
        panels = cpu_native.to_panels(weight)
        try:
            torch.set_num_threads(1)
            alone = cpu_native.linear(x, panels, None)
            torch.set_num_threads(threads)
            shared = cpu_native.linear(x, panels, None)
        finally:
            torch.set_num_threads(before)
        assert _rel(alone, x.double() @ weight.double().T) < 1e-5
        assert torch.equal(shared, alone), (threads, rows, n, k)


@pytest.mark.parametrize("most", [64, None])
def test_packed_layer_sends_rows_to_the_native_kernel_up_to_panel_rows(monkeypatch, most):
    """Up to the policy's panel rows through the panels, wider steps through oneDNN; both
    give the product. `most`: a limit set here (the rule), or this CPU's own (None: no
    limit on an AVX2 CPU, where the panels beat oneDNN at prompt chunks' row counts too)."""
    if not cpu_linear.can_pack(torch.float32, torch.device("cpu")):
        pytest.skip("oneDNN cannot pack here")
    policy = cpu_native.machine_policy()
    if most is not None:
        policy = dataclasses.replace(policy, fp32_rows=most)
    most = policy.panel_rows(torch.float32)
    gen = torch.Generator().manual_seed(2)
    layer = PackedLinear(576, {"a": range(100), "b": range(60)})
    weight = layer.weight.data = torch.randn(160, 576, generator=gen)
    layer.pack_for_cpu(None, policy)
    # one copy besides the panels, oneDNN's, unless the panels take every step (then none)
    every = policy.every_step(torch.float32)
    assert layer.weight is None and layer.panels is not None and (layer.packed is None) == every
    calls = []
    real = cpu_native.linear
    monkeypatch.setattr(cpu_native, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 64, 65, 200):
        x = torch.randn(rows, 576, generator=gen)
        assert _rel(layer(x), x.double() @ weight.double().T) < 1e-5
    assert calls == [r for r in (1, 64, 65, 200) if r <= most]  # wider steps go through oneDNN
    if every:  # the panels are the only copy: an input of any shape or layout goes through them
        x = torch.randn(2, 7, 576, generator=gen)
        assert _rel(layer(x).reshape(14, -1), x.reshape(14, -1).double() @ weight.double().T) < 1e-5
        x = torch.randn(576, 9, generator=gen).T  # its rows' elements 9 apart
        assert _rel(layer(x), x.double() @ weight.double().T) < 1e-5


# bf16: inputs are bf16 values, references float64 of them; the kernels compute in fp32
# and round their output to bf16 (8 bits: a relative step of 2^-8)
BF16_TOL = 2**-7


def _bf16(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


@pytest.mark.parametrize("rows", [1, 7, 600])
def test_rms_norm_bf16_rounds_where_hugging_face_does(rows):
    """The residual sum is bf16(x + residual) exactly; the output is within a rounding or
    two of the float64 norm of that sum, element by element."""
    gen = torch.Generator().manual_seed(rows)
    x, res = _bf16(rows, 576, gen=gen, scale=3), _bf16(rows, 576, gen=gen, scale=3)
    weight = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    out, summed = cpu_native.rms_norm(x, weight, 1e-5, res)
    assert out.dtype == summed.dtype == torch.bfloat16
    assert torch.equal(summed, (x.float() + res.float()).bfloat16())
    want = _rms_f64(summed, weight, 1e-5)
    assert ((out.double() - want).abs() <= BF16_TOL * want.abs() + 1e-30).all()
    out, _ = cpu_native.rms_norm(x, weight, 1e-5)
    want = _rms_f64(x, weight, 1e-5)
    assert ((out.double() - want).abs() <= BF16_TOL * want.abs() + 1e-30).all()


def test_rotary_bf16_in_place_with_fp32_tables():
    gen = torch.Generator().manual_seed(3)
    tokens, heads, d = 6, 9, 64
    x = _bf16(tokens, heads, d, gen=gen)
    before = x.double()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.arange(tokens, dtype=torch.float64)[:, None] * 7.0 * inv_freq
    cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]
    assert apply_rotary(x, cos, sin).data_ptr() == x.data_ptr() and x.dtype == torch.bfloat16
    x1, x2 = before[..., : d // 2], before[..., d // 2 :]
    c, s = cos.double(), sin.double()
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    assert _rel(x, want) < BF16_TOL


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64])
@pytest.mark.parametrize(("n", "k"), [(37, 576), (960, 576), (130, 1536), (6, 16)])
def test_linear_bf16_against_float64(rows, n, k):
    """Every tile height (1-8 rows, several groups), a last panel of fewer than 32 columns,
    a bias, rows of x that lie apart."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = _bf16(rows, k + 48, gen=gen)[:, 16 : 16 + k]
    weight, bias = _bf16(n, k, gen=gen, scale=k**-0.5), _bf16(n, gen=gen)
    panels = cpu_native.to_panels(weight)
    assert cpu_native.takes_linear(x, panels) and not cpu_native.takes_linear(x.float(), panels)
    want = x.double() @ weight.double().T
    out = cpu_native.linear(x, panels, None)
    assert out.dtype == torch.bfloat16 and _rel(out, want) < BF16_TOL
    assert _rel(cpu_native.linear(x, panels, bias), want + bias.double()) < BF16_TOL
    assert cpu_native.to_panels(weight[:, :-1]) is None  # an odd k: not this kernel's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_rows_do_not_depend_on_the_rows_beside_them(dtype):
    """A row's result is bitwise the same alone and among up to 17 (batch-invariant): each
    sum runs over k in one order at any tile height, and a row alone (read over several
    panels at once) sums as a row among others, so a token decoded alone and the same token
    among a verification's drafts round alike."""
    gen = torch.Generator().manual_seed(7)
    for n, k in ((960, 576), (1536, 576), (576, 1536), (130, 1536)):
        panels = cpu_native.to_panels(_bf16(n, k, gen=gen, scale=k**-0.5).to(dtype))
        x = _bf16(17, k, gen=gen).to(dtype)
        alone = torch.cat([cpu_native.linear(x[i : i + 1], panels, None) for i in range(17)])
        for rows in (2, 3, 5, 9, 17):
            assert torch.equal(cpu_native.linear(x[:rows], panels, None), alone[:rows]), (n, k, rows)


def test_bf16_layers_take_the_native_paths_and_agree_with_torch(monkeypatch):
    """A bf16 RMSNorm, its fused add and a packed bf16 linear give what the pure-torch
    (bf16) paths give, within bf16's rounding."""
    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    norm.weight.data = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    layer = PackedLinear(576, {"a": range(100), "b": range(60)}).to(torch.bfloat16)
    layer.weight.data = _bf16(160, 576, gen=gen, scale=576**-0.5)
    weight = layer.weight.data.clone()
    layer.panels = cpu_native.to_panels(weight)._replace(rows=64)  # as pack_for_cpu leaves it (bf16)
    x, res = _bf16(4, 576, gen=gen), _bf16(4, 576, gen=gen)
    calls = []
    for name in ("rms_norm", "linear"):
        real = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    native = norm(x), norm.add_and_norm(x, res), layer(x)
    assert calls == ["rms_norm", "rms_norm", "linear"]
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    layer.panels = None
    torch_path = norm(x), norm.add_and_norm(x, res), layer(x)
    pairs = zip((native[0], native[1][0], native[2]), (torch_path[0], torch_path[1][0], torch_path[2]))
    for got, want in pairs:
        assert got.dtype == torch.bfloat16 and _rel(got, want.double()) < BF16_TOL
    assert torch.equal(native[1][1], torch_path[1][1])


@pytest.mark.parametrize("n", [1, 7, 8, 13, 49152])
def test_argmax_is_torchs_first_largest_index(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(9, n + 3, generator=gen)[:, :n]  # rows 3 values apart beyond n: a strided view
    x[1] = 0.5  # all equal: the first
    x[2, n // 2 :] = x[2].max() + 1  # equal maxima in several lanes and the tail: the first
    x[3] = float("-inf")
    x[4, n - 1] = float("nan")  # a NaN wins, as in torch
    x[5, :: max(1, n // 3)] = float("nan")  # the first NaN
    x[6, n - 1] = float("inf")
    got = cpu_native.argmax(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1))
