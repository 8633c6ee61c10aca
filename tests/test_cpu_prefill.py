"""The native prefill attention (kernels/cpu_prefill.c) against a float64 causal
grouped-query attention written here: chunks with and without a cached prefix, query
lengths around the kernel's 6-row tiles, contexts around its key blocks, strided K/V (the
fused qkv projection's views), fp32 and bf16; a row's output does not depend on the chunk
it is computed in; the torch backend takes it for prefill chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvray.kernels import cpu_native

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler: native ops not built")


def _attention_f64(q, k, v, scale):
    """q [T, Hq, D] at the last T of L positions; k, v [L, Hkv, D] -> [T, Hq, D]."""
    q_len, num_q_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.double(), k) * scale
    pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    scores = scores.masked_fill(torch.arange(kv_len)[None, :] > pos, float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v)


def _qkv(q_len, kv_len, num_q_heads, num_kv_heads, head_dim, dtype, seed):
    """q rows of the chunk and the context's k, v as views into fused [L, (Hq + 2 Hkv) D] rows."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(kv_len, width, generator=gen) * 2).to(dtype)
    q = qkv[kv_len - q_len :, : num_q_heads * head_dim].view(q_len, num_q_heads, head_dim)
    kv = qkv[:, num_q_heads * head_dim :].view(kv_len, 2 * num_kv_heads, head_dim)
    return q, kv[:, :num_kv_heads], kv[:, num_kv_heads:]


@pytest.mark.parametrize(
    "q_len,kv_len,heads",
    [
        (1, 1, (9, 3)),
        (5, 5, (9, 3)),
        (6, 6, (4, 4)),
        (7, 70, (9, 3)),  # a chunk after a cached prefix
        (13, 13, (8, 1)),
        (64, 64, (9, 3)),
        (65, 200, (9, 3)),
        (300, 300, (4, 2)),
    ],
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp32_against_float64(q_len, kv_len, heads, head_dim):
    q, k, v = _qkv(q_len, kv_len, *heads, head_dim, torch.float32, seed=q_len * 1000 + kv_len)
    out = cpu_native.prefill_attention(q, k, v, head_dim**-0.5)
    want = _attention_f64(q, k, v, head_dim**-0.5)
    assert out.shape == want.shape and out.dtype == torch.float32
    assert (out.double() - want).abs().max().item() < 2e-5


@pytest.mark.parametrize("q_len,kv_len", [(9, 9), (37, 100), (256, 256)])
def test_bf16_against_float64(q_len, kv_len):
    q, k, v = _qkv(q_len, kv_len, 9, 3, 64, torch.bfloat16, seed=kv_len)
    out = cpu_native.prefill_attention(q, k, v, 0.125)
    want = _attention_f64(q, k, v, 0.125)  # from the same bf16 inputs
    assert out.dtype == torch.bfloat16
    # fp32 math, the output rounded once: within bf16's half-ulp of each value (plus a little)
    assert ((out.double() - want).abs() <= want.abs() * 2**-8 + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_chunk(dtype):
    """Chunked prefill gives every row exactly what the whole prompt at once gives."""
    q, k, v = _qkv(150, 150, 9, 3, 64, dtype, seed=7)
    whole = cpu_native.prefill_attention(q, k, v, 0.125)
    for lo, hi in [(0, 1), (0, 50), (50, 57), (57, 150), (149, 150)]:
        part = cpu_native.prefill_attention(q[lo:hi], k[:hi], v[:hi], 0.125)
        assert torch.equal(part, whole[lo:hi])


def test_the_torch_backend_takes_it_and_sdpa_agrees():
    """_prefill_attention's native path and its SDPA path (the kernel off) agree."""
    q, k, v = _qkv(100, 100, 9, 3, 64, torch.float32, seed=3)
    assert cpu_native.takes_prefill(q, k, v)
    sdpa = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        scale=0.125,
        enable_gqa=True,
    )[0].transpose(0, 1)
    assert (cpu_native.prefill_attention(q, k, v, 0.125) - sdpa).abs().max().item() < 2e-5
    assert not cpu_native.takes_prefill(q, k.to(torch.bfloat16), v.to(torch.bfloat16))  # mixed dtypes
    assert not cpu_native.takes_prefill(q[..., :32], k[..., :32], v[..., :32])  # head_dim 32
