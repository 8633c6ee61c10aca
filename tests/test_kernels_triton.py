"""Triton paged-attention kernels against a float64 reference written here.

Without CUDA the kernels run under the Triton interpreter (set before any kernel module is
imported); bf16 arithmetic is wrong there, so bf16 is checked only by the `gpu` tests.
Error bound: max |out - ref| / max |ref| per dtype (REL_TOL): fp32 2e-5, fp16 2e-3, bf16
1.6e-2. Measured under the interpreter: fp32 <= 3e-7, fp16 <= 3.5e-4 (fp16 rounding of the
softmax weights and of the output). `out` is filled with NaN before every call, so a row
the kernel forgets to write fails the check.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from attention_cases import attention_f64, make_batch  # noqa: E402

from kvray.kernels import triton_attention, triton_cache, triton_decode_split  # noqa: E402
from kvray.kernels.backend import AttentionMetadata, get_backend  # noqa: E402
from kvray.kernels.reference import unified_attention_ref  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    # Another test module may have imported the kernels before the interpreter was switched
    # on: decorate them again (dependants after what they import) and drop cached names.
    if type(triton_attention._unified_attention_kernel).__name__ != "InterpretedFunction":
        for name in (
            "triton_cache",
            "triton_attend",
            "triton_decode_split",
            "triton_attention",
            "triton_backend",
        ):
            if f"kvray.kernels.{name}" in sys.modules:
                importlib.reload(sys.modules[f"kvray.kernels.{name}"])
        for name in ("reshape_and_cache", "unified_attention"):
            vars(sys.modules["kvray.kernels"]).pop(name, None)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run_and_check(batch, scale, window, dtype, **kwargs):
    out = torch.full_like(batch["q"], float("nan"))
    triton_attention.unified_attention(
        batch["q"],
        batch["k_cache"],
        batch["v_cache"],
        out,
        batch["cu_seqlens_q"],
        batch["seq_lens"],
        batch["block_tables"],
        scale,
        window,
        **kwargs,
    )
    ref = attention_f64(**batch, scale=scale, window=window)
    assert not torch.isnan(out).any(), "rows left unwritten"
    rel = ((out.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert rel < REL_TOL[dtype], f"relative error {rel:.2e} >= {REL_TOL[dtype]:.0e}"
    return out


# decode (q_len 1), a chunk after a cached prefix, a fresh prefill, a decode at position 0
MIXED = dict(q_lens=[1, 19, 13, 1], seq_lens=[37, 50, 13, 1])

MIXED_CASES = [  # (num_kv_heads, group, head_dim, block_size, dtype, window)
    (2, 1, 64, 16, torch.float32, None),
    (1, 3, 64, 32, torch.float16, None),
    (1, 4, 128, 16, torch.float32, 8),
    (1, 8, 128, 32, torch.float16, 20),
    (2, 4, 80, 16, torch.float32, None),
    (1, 2, 96, 32, torch.float16, 30),
    (1, 4, 256, 16, torch.float32, 20),  # Gemma 3 270M's shape: 4 q heads on 1 KV head, head_dim 256
]


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size,dtype,window", MIXED_CASES)
def test_mixed_batch(num_kv_heads, group, head_dim, block_size, dtype, window):
    batch = make_batch(
        **MIXED,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=group,
    )
    run_and_check(batch, head_dim**-0.5, window, dtype, force_split=False)


@pytest.mark.parametrize("seed", range(6))
def test_random_ragged_batches(seed):
    """Random mixes of decodes, chunks after a cached prefix and fresh prefills."""
    rng = random.Random(seed)
    q_lens, seq_lens = [], []
    for _ in range(rng.randint(2, 5)):
        kind = rng.choice(["decode", "chunk", "fresh"])
        q_len = 1 if kind == "decode" else rng.randint(2, 40)
        q_lens.append(q_len)
        seq_lens.append(q_len + (0 if kind == "fresh" else rng.randint(0 if q_len > 1 else 1, 90)))
    dtype = [torch.float32, torch.float16][seed // 2 % 2]
    window = rng.choice([None, rng.randint(1, 60)])
    batch = make_batch(
        q_lens,
        seq_lens,
        num_kv_heads=1,
        group=[1, 3, 4, 8][seed % 4],
        head_dim=[64, 128][seed % 2],
        block_size=rng.choice([16, 32]),
        dtype=dtype,
        seed=seed,
    )
    run_and_check(batch, 0.09, window, dtype)


@pytest.mark.parametrize("group,window", [(1, None), (4, 50)])
def test_long_prefill_spans_several_q_blocks(group, window):
    batch = make_batch(
        q_lens=[130, 1],
        seq_lens=[160, 40],
        num_kv_heads=1,
        group=group,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
    )
    run_and_check(batch, 0.125, window, torch.float32)


DECODE_CASES = [  # (num_kv_heads, group, head_dim, block_size, dtype, window, num_splits)
    (1, 4, 64, 16, torch.float32, None, 3),
    (1, 8, 128, 32, torch.float16, 40, 2),
    (2, 1, 128, 16, torch.float32, 100, 3),
    (1, 3, 64, 32, torch.float32, None, 5),  # more splits than the short sequence fills
    (1, 4, 256, 16, torch.float32, 64, 2),  # Gemma 3's local layers (head_dim 256, a window)
]


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size,dtype,window,num_splits", DECODE_CASES)
def test_decode_split_and_plain(num_kv_heads, group, head_dim, block_size, dtype, window, num_splits):
    batch = make_batch(
        q_lens=[1, 1, 0, 1],
        seq_lens=[150, 70, 5, 9],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    split = run_and_check(batch, 0.1, window, dtype, force_split=True, num_splits=num_splits)
    plain = run_and_check(batch, 0.1, window, dtype, force_split=False)
    assert (split.float() - plain.float()).abs().max() < 2 * REL_TOL[dtype] * plain.abs().max()


def test_decode_auto_rule_takes_split_path(monkeypatch):
    calls = []
    real = triton_decode_split.split_decode
    monkeypatch.setattr(triton_decode_split, "split_decode", lambda *a: calls.append(a) or real(*a))
    batch = make_batch(
        q_lens=[1], seq_lens=[600], num_kv_heads=1, group=2, head_dim=64, block_size=32, dtype=torch.float32
    )
    run_and_check(batch, 0.125, None, torch.float32)
    assert [c[5] for c in calls] == [2]  # splits: min(cdiv(2*132, 1), 600 // 256, 32)


def test_choose_num_splits_rule():
    choose = triton_decode_split.choose_num_splits
    assert choose(1, 8, 1, 4096, 132) == 16  # cdiv(264, 8)=33, 4096 // 256 = 16
    assert choose(4, 8, 1, 100_000, 132) == 9  # cdiv(264, 32) = 9
    assert choose(1, 1, 1, 100_000, 132) == 32  # capped at MAX_SPLITS
    assert choose(1, 8, 1, 300, 132) == 1  # short context: plain
    assert choose(1, 8, 2, 4096, 132) == 1  # not decode-only: plain
    assert choose(20, 8, 1, 4096, 132) == 1  # 160 programs already fill 132 SMs


def test_force_split_rejects_prefill():
    batch = make_batch(**MIXED, num_kv_heads=1, group=1, head_dim=64, block_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="force_split"):
        triton_attention.unified_attention(
            batch["q"],
            batch["k_cache"],
            batch["v_cache"],
            torch.empty_like(batch["q"]),
            batch["cu_seqlens_q"],
            batch["seq_lens"],
            batch["block_tables"],
            0.1,
            force_split=True,
        )


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,block_size,dtype,cache_dtype",
    [
        (2, 64, 16, torch.float32, torch.float32),
        (3, 80, 32, torch.float16, torch.float16),
        (1, 128, 16, torch.float32, torch.float16),
    ],
)
def test_reshape_and_cache_writes_exact_slots(num_kv_heads, head_dim, block_size, dtype, cache_dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks = 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(DEVICE)
    qkv = torch.randn(9, 3, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]  # strided views, as a fused QKV projection gives them
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:9]
    slots[[2, 6]] = -1
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect_k[s // block_size, s % block_size] = key[t].to(cache_dtype)
            expect_v[s // block_size, s % block_size] = value[t].to(cache_dtype)
    triton_cache.reshape_and_cache(key, value, k_cache, v_cache, slots.to(DEVICE))
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def test_tiny_case_matches_torch_reference():
    torch.manual_seed(0)
    kc, vc = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    key, val = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    triton_cache.reshape_and_cache(key, val, kc, vc, torch.tensor([17, -1, 18]))
    assert torch.equal(kc[1, 1], key[0]) and torch.equal(vc[1, 2], val[2])
    assert kc.count_nonzero() == 2 * 2 * 64  # two tokens, two heads; slot -1 skipped
    q = torch.randn(1, 4, 64)
    args = (
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([19], dtype=torch.int32),
        torch.tensor([[3, 1]], dtype=torch.int32),
        0.125,
    )
    out, expect = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    triton_attention.unified_attention(q, kc, vc, out, *args, sliding_window=None)
    unified_attention_ref(q, kc, vc, expect, *args, sliding_window=None)
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=0)


def test_backend_stores_then_attends():
    backend = get_backend("triton", torch.device(DEVICE))
    batch = make_batch(
        q_lens=[1, 6],
        seq_lens=[20, 6],
        num_kv_heads=2,
        group=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
    )
    tables = batch["block_tables"].cpu()
    slots = torch.tensor(
        [tables[0, 19 // 16] * 16 + 19 % 16, *(tables[1, 0] * 16 + torch.arange(6)).tolist()]
    )
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(7, 2, 64, generator=gen).to(DEVICE) for _ in range(2))
    meta = AttentionMetadata(
        slot_mapping=slots.to(DEVICE),
        cu_seqlens_q=batch["cu_seqlens_q"],
        seq_lens=batch["seq_lens"],
        block_tables=batch["block_tables"],
        query_lens=[1, 6],
        seq_lens_host=[20, 6],
        block_size=16,
    )
    backend.prepare(meta)
    out = backend.forward(batch["q"], k, v, batch["k_cache"], batch["v_cache"], meta, 0.125, None)
    assert torch.equal(batch["k_cache"][tables[1, 0], :6], k[1:])
    ref = attention_f64(**batch, scale=0.125, window=None)
    assert (out.double().cpu() - ref).abs().max() < REL_TOL[torch.float32] * ref.abs().max()


# ---- compiled on a GPU: the same checks, bf16 included, longer contexts ----

GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(
    "num_kv_heads,group,head_dim,block_size,window",
    [
        (8, 1, 64, 16, None),
        (4, 3, 96, 32, None),
        (2, 4, 128, 16, 256),
        (1, 8, 128, 32, None),
        (4, 4, 80, 16, 64),
    ],
)
def test_gpu_mixed_batch(dtype, num_kv_heads, group, head_dim, block_size, window):
    batch = make_batch(
        q_lens=[1, 300, 1, 77, 1, 513],
        seq_lens=[1500, 900, 33, 77, 4000, 513],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    run_and_check(batch, head_dim**-0.5, window, dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(
    "group,head_dim,block_size,window",
    [
        (4, 128, 16, None),
        (8, 64, 32, 1000),
        (1, 128, 32, None),
    ],
)
@pytest.mark.parametrize("force_split", [None, True, False])
def test_gpu_decode(dtype, group, head_dim, block_size, window, force_split):
    batch = make_batch(
        q_lens=[1, 1, 1],
        seq_lens=[5000, 2047, 17],
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    run_and_check(batch, head_dim**-0.5, window, dtype, force_split=force_split)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_reshape_and_cache(dtype):
    test_reshape_and_cache_writes_exact_slots(8, 128, 16, dtype, dtype)
