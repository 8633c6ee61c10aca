"""The CPU attention backend against a float64 reference: the native decode kernel
(kernels/cpu_decode.c) and the pure-torch path, on ragged mixes of decodes, chunks after a
cached prefix and fresh prefills, with grouped-query heads and sliding windows; shapes the
kernel does not take fall back to torch. Bound: max |out - ref| / max |ref| < 2e-5 (fp32)."""

from __future__ import annotations

import itertools

import pytest
import torch
from attention_cases import attention_f64, dequantized, make_batch, quantize_batch

from kvray.kernels import cpu_build, cpu_native
from kvray.kernels.backend import AttentionMetadata, get_backend
from kvray.kernels.kv_quant import dequantize
from kvray.kernels.torch_backend import split_by_length

REL_TOL = 2e-5
# decodes of several lengths (one at position 0), a short query after a prefix (7 rows,
# as a decode verifying 6 drafts: attended a row at a time), a fresh prefill, and a
# chunk after a prefix long enough for the prefill path
Q_LENS = [1, 1, 7, 1, 18, 1, 20]
SEQ_LENS = [37, 300, 40, 1, 18, 129, 90]
CASES = [  # (num_kv_heads, group, head_dim, block_size, window, native)
    (3, 3, 64, 16, None, True),  # SmolLM2-135M's heads
    (2, 1, 64, 16, None, True),
    (1, 8, 128, 32, None, True),
    (2, 4, 64, 16, 50, True),
    (1, 9, 64, 16, None, False),  # more than 8 query heads per KV head
    (2, 2, 80, 16, None, False),  # head_dim not a multiple of 32
    (1, 4, 256, 16, 100, True),  # Gemma 3 270M's local layers: head_dim 256, a window
]


def _attend(batch, q_lens, seq_lens, block_size, window):
    """The backend's output; each new token's K/V is the one the cache already holds at its
    slot (written back unchanged), so the reference reads the same context."""
    tables = batch["block_tables"]
    slots = []
    for i, (q_len, ctx) in enumerate(zip(q_lens, seq_lens)):
        pos = torch.arange(ctx - q_len, ctx)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
    slots = torch.cat(slots)
    k_cache, v_cache = batch["k_cache"], batch["v_cache"]
    num_kv_heads, head_dim = k_cache.shape[2:]
    k = k_cache.view(-1, num_kv_heads, head_dim)[slots].clone()
    v = v_cache.view(-1, num_kv_heads, head_dim)[slots].clone()
    scales = (batch.get("k_scale"), batch.get("v_scale"))
    # an 8-bit cache: its values (in the model's dtype), which the write quantizes again
    if scales[0] is not None:
        k = dequantize(k, scales[0].view(-1, num_kv_heads)[slots], batch["q"].dtype)
        v = dequantize(v, scales[1].view(-1, num_kv_heads)[slots], batch["q"].dtype)
    meta = AttentionMetadata(
        slot_mapping=slots,
        cu_seqlens_q=batch["cu_seqlens_q"],
        seq_lens=batch["seq_lens"],
        block_tables=tables,
        query_lens=q_lens,
        seq_lens_host=seq_lens,
        block_size=block_size,
    )
    backend = get_backend("torch", torch.device("cpu"))
    backend.prepare(meta)
    return backend.forward(batch["q"], k, v, k_cache, v_cache, meta, 0.125, window, *scales)


def _native_calls(monkeypatch, native: bool) -> list:
    """The native kernel's calls from here on; with `native` False the library is hidden
    (the torch path runs), with it True the test is skipped where it is not built."""
    if native and cpu_native.library() is None:
        pytest.skip("no C compiler here: the native kernel is not built")
    if not native:
        monkeypatch.setattr(cpu_native, "library", lambda: None)
    calls = []
    real = cpu_native.paged_decode
    monkeypatch.setattr(cpu_native, "paged_decode", lambda *a: calls.append(a) or real(*a))
    return calls


def _check(out, batch, window):
    if "k_scale" in batch:  # the reference reads the 8-bit cache as written, dequantized
        batch = dequantized(batch)
    ref = attention_f64(**batch, scale=0.125, window=window)
    rel = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert rel < REL_TOL, f"relative error {rel:.2e}"


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size,window,native", CASES)
def test_native_kernel_matches_float64(
    monkeypatch, num_kv_heads, group, head_dim, block_size, window, native
):
    if cpu_native.library() is None:
        pytest.skip("no C compiler here: the native kernel is not built")
    calls = []
    real = cpu_native.paged_decode
    monkeypatch.setattr(cpu_native, "paged_decode", lambda *a: calls.append(a) or real(*a))
    batch = make_batch(
        Q_LENS, SEQ_LENS, num_kv_heads, group, head_dim, block_size, torch.float32, device="cpu"
    )
    out = _attend(batch, Q_LENS, SEQ_LENS, block_size, window)
    _check(out, batch, window)
    assert len(calls) == int(native)  # it ran where it can, and torch where it cannot
    if native:
        # the decode rows, shortest context first: row 9 sees 1 position; rows 2-8 (the
        # short query) see 34-40, so row 5 ties with row 0's 37; row 28 sees 129, row 1 300
        assert calls[0][6].tolist() == [9, 2, 3, 4, 0, 5, 6, 7, 8, 28, 1]


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size,window,native", CASES[:4])
def test_pure_torch_path_matches_float64(
    monkeypatch, num_kv_heads, group, head_dim, block_size, window, native
):
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    batch = make_batch(
        Q_LENS, SEQ_LENS, num_kv_heads, group, head_dim, block_size, torch.float32, device="cpu"
    )
    _check(_attend(batch, Q_LENS, SEQ_LENS, block_size, window), batch, window)


def test_the_kernel_is_built_once_into_the_cache(tmp_path, monkeypatch):
    if cpu_native.library() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("KVRAY_CACHE", str(tmp_path))
    import shutil

    compiler = shutil.which("cc") or shutil.which("gcc")
    first = cpu_build._build(compiler)
    stamp = first.stat().st_mtime_ns
    assert first.parent == tmp_path / "native" and first.suffix == ".so"
    assert cpu_build._build(compiler) == first and first.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("window", [None, 700, 100])
def test_native_kernel_splits_long_contexts_into_spans(window):
    """Contexts past one span (512 positions) are split across threads and merged; a
    window may start mid-span or leave a single span."""
    if cpu_native.library() is None:
        pytest.skip("no C compiler here: the native kernel is not built")
    q_lens, seq_lens = [1, 1, 1, 1], [1100, 513, 40, 1537]
    batch = make_batch(q_lens, seq_lens, 3, 3, 64, 16, torch.float32, device="cpu")
    _check(_attend(batch, q_lens, seq_lens, 16, window), batch, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 700])
def test_native_decode_rows_do_not_depend_on_the_rows_beside_them(dtype, window):
    """A row's output is bitwise the same alone and in a batch (batch-invariant): spans
    start at multiples of 512 positions whatever the step holds, and a step of few spans
    splits by KV head, which leaves each head's sums unchanged. So a token decoded alone
    and the same token among a verification's rows round alike."""
    if cpu_native.library() is None:
        pytest.skip("no C compiler here: the native kernel is not built")
    seq_lens = [1537, 5, 300, 1100, 513, 2100, 40, 700]
    batch = make_batch([1] * len(seq_lens), seq_lens, 3, 3, 64, 16, dtype, seed=5, device="cpu")
    lens = batch["seq_lens"]

    def decode(seqs: list[int]) -> torch.Tensor:
        out = torch.zeros_like(batch["q"])
        rows = torch.tensor(seqs, dtype=torch.int64)
        tables = batch["block_tables"][rows].contiguous()
        cpu_native.paged_decode(
            batch["q"], out, batch["k_cache"], batch["v_cache"], tables, lens[rows], rows, 0.125, window
        )
        return out[rows]

    together = decode(list(range(len(seq_lens))))
    for i in range(len(seq_lens)):
        assert torch.equal(decode([i])[0], together[i]), (i, seq_lens[i])
    assert torch.equal(decode([3, 0, 5]), together[[3, 0, 5]])


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize(
    "q_lens,seq_lens,window",
    [(Q_LENS, SEQ_LENS, None), (Q_LENS, SEQ_LENS, 50), ([1, 1, 1, 1], [1100, 513, 40, 1537], None)],
    ids=["mix", "window", "spans"],
)
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (1, 8, 128), (2, 1, 32)])
def test_bf16_cache_matches_float64(
    monkeypatch, native, q_lens, seq_lens, window, num_kv_heads, group, head_dim
):
    """bf16 q and caches (a bf16 model's): the native kernel reads the bf16 rows, computes
    in fp32 (with AVX512-BF16: the scores by `vdpbf16ps`) and rounds the output once; the
    torch path runs in bf16. Bound: 1 % of the largest value (bf16 keeps 8 bits)."""
    calls = _native_calls(monkeypatch, native)
    batch = make_batch(q_lens, seq_lens, num_kv_heads, group, head_dim, 16, torch.bfloat16, device="cpu")
    out = _attend(batch, q_lens, seq_lens, 16, window)
    assert out.dtype == torch.bfloat16 and len(calls) == int(native)
    ref = attention_f64(**batch, scale=0.125, window=window)
    rel = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-2, f"relative error {rel:.2e}"


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize(
    "num_kv_heads,group,head_dim,window", [(3, 3, 64, None), (2, 4, 64, 50), (1, 8, 128, None)]
)
def test_int8_cache_matches_float64_of_its_dequantized_values(
    monkeypatch, native, num_kv_heads, group, head_dim, window
):
    """An int8 cache on every path (native decode rows, torch decode groups, prefill
    chunks reading their prefix, fresh prefills): the reference is float64 attention over
    the cache's codes times scales as they stand after the step's writes."""
    calls = _native_calls(monkeypatch, native)
    batch = make_batch(Q_LENS, SEQ_LENS, num_kv_heads, group, head_dim, 16, torch.float32, device="cpu")
    batch = quantize_batch(batch, "int8")
    before = batch["k_cache"].clone()
    out = _attend(batch, Q_LENS, SEQ_LENS, 16, window)
    assert (batch["k_cache"].int() - before.int()).abs().max() <= 1  # re-quantizing moved codes by <= 1
    _check(out, batch, window)
    assert len(calls) == int(native)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_int8_cache_of_a_bf16_model_matches_float64(monkeypatch, native):
    """A bf16 model's int8 cache: the native int8 kernel takes the bf16 queries widened to
    fp32 and rounds its outputs to bf16 once (it ran the torch path before: 3.5x slower
    decode); the torch path dequantizes to bf16. Bound as for bf16 caches: 1 % of the
    largest value."""
    calls = _native_calls(monkeypatch, native)
    batch = make_batch(Q_LENS, SEQ_LENS, 3, 3, 64, 16, torch.bfloat16, device="cpu")
    batch = quantize_batch(batch, "int8")
    out = _attend(batch, Q_LENS, SEQ_LENS, 16, None)
    assert out.dtype == torch.bfloat16 and len(calls) == int(native)
    ref = attention_f64(**dequantized(batch), scale=0.125, window=None)
    rel = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-2, f"relative error {rel:.2e}"


def _padded_cost(lengths: list[int], ends: list[int], group_cost: int) -> int:
    cost, begin = 0, 0
    for end in ends:
        cost += (end - begin) * lengths[end - 1] + group_cost
        begin = end
    return cost


def test_decode_groups_split_by_length_hand_checked():
    # two clusters of lengths: one cut between them beats padding the short ones to 1000
    # (4 * 1000 + 10 = 4010 against 2 * 10 + 10 + 2 * 1000 + 10 = 2040)
    assert split_by_length([10, 10, 1000, 1000], 10, 4) == [2, 4]
    # a group's fixed cost above the padding saved: one group
    assert split_by_length([10, 10, 1000, 1000], 5000, 4) == [4]
    assert split_by_length([7], 1024, 4) == [1]
    assert split_by_length([5, 6, 7], 0, 1) == [3]  # one group allowed


def test_decode_groups_split_by_length_is_optimal_against_every_split():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        lengths = sorted(torch.randint(1, 3000, (n,), generator=gen).tolist())
        group_cost = [0, 10, 1024][int(torch.randint(0, 3, (1,), generator=gen))]
        max_groups = int(torch.randint(1, 5, (1,), generator=gen))
        ends = split_by_length(lengths, group_cost, max_groups)
        assert ends[-1] == n and len(ends) <= max_groups and ends == sorted(set(ends))
        every = [
            [*cuts, n] for k in range(min(max_groups, n)) for cuts in itertools.combinations(range(1, n), k)
        ]
        assert _padded_cost(lengths, ends, group_cost) == min(
            _padded_cost(lengths, e, group_cost) for e in every
        )
