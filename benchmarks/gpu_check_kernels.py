"""The GPU check's kernel sections: correctness against float64, decode and prefill timings.

Every timing runs kvray's `unified_attention` on a paged batch (blocks scattered by a
random permutation, as a long-running engine leaves them) and torch SDPA on the same
values laid out contiguously, and checks that the two outputs agree, so a fast wrong
kernel cannot pass. kvray's kernel modules are imported inside the functions, after the
caller has decided whether the Triton interpreter is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gpu_check_plan import Plan, Timer, table
from paged_batch import attention_f64, contiguous_kv, make_paged_batch, relative_error

REL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # as the tests
COPY_TARGET, SDPA_TARGET = 0.70, 1.2


def check_correctness(plan: Plan) -> tuple[list[str], bool]:
    """(a) Every case in every dtype against float64; plus exact cache writes."""
    from kvray.kernels.triton_attention import unified_attention

    rows, ok = [], True
    for dtype in plan.check_dtypes:
        for case in plan.cases:
            b = make_paged_batch(
                case.q_lens,
                case.seq_lens,
                case.num_kv_heads,
                case.group,
                case.head_dim,
                case.block_size,
                dtype,
                plan.device,
            )
            out = torch.full_like(b.q, float("nan"))
            scale = case.head_dim**-0.5
            unified_attention(
                b.q, b.k_cache, b.v_cache, out, *b.args(), scale, case.window, force_split=case.force_split
            )
            err = relative_error(out, attention_f64(b, scale, case.window))
            passed = err < REL_TOL[dtype]
            ok &= passed
            rows.append(
                [case.name, str(dtype)[6:], f"{err:.2e}", f"{REL_TOL[dtype]:.1e}", "ok" if passed else "FAIL"]
            )
        exact = _check_cache_writes(dtype, plan.device)
        ok &= exact
        rows.append(
            [
                "reshape_and_cache, slot -1 skipped",
                str(dtype)[6:],
                "exact" if exact else "differs",
                "exact",
                "ok" if exact else "FAIL",
            ]
        )
    return table(["case", "dtype", "max rel err", "bound", "result"], rows), ok


def _check_cache_writes(dtype: torch.dtype, device: torch.device) -> bool:
    """reshape_and_cache writes exactly the listed slots of a [8, 16, 8, 128] cache, skips -1."""
    from kvray.kernels.triton_cache import reshape_and_cache

    gen = torch.Generator(device).manual_seed(1)
    k_cache, v_cache, key, value = (
        torch.randn(shape, generator=gen, device=device).to(dtype)
        for shape in [(8, 16, 8, 128)] * 2 + [(9, 8, 128)] * 2
    )
    slots = torch.tensor([5, -1, 40, 17, 3, -1, 66, 0, 127], device=device)
    keep = slots >= 0
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    expect_k.view(-1, 8, 128)[slots[keep]] = key[keep]
    expect_v.view(-1, 8, 128)[slots[keep]] = value[keep]
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    return torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def copy_bandwidth(plan: Plan, timer: Timer) -> float:
    """Bytes/s (read + write) of a device-to-device copy far larger than the L2 cache."""
    n = (2 << 30) if plan.device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    return 2 * n / (timer.median_ms(lambda: dst.copy_(src)) * 1e-3)


@dataclass
class Timing:
    kvray_ms: float  # unified_attention on the paged batch
    sdpa_ms: float  # torch SDPA on the same values laid out contiguously
    kv_bytes: int  # K and V bytes the kernel has to read
    matches: bool  # the two outputs agree within the dtype's bound


def time_against_sdpa(plan: Plan, timer: Timer, batch: int, q_len: int, ctx: int) -> Timing:
    """kvray vs SDPA on `batch` sequences of `ctx` positions whose last `q_len` are queries.

    q_len 1 (decode): no mask, so SDPA gets q as [S, Hkv, group, D] against K/V
    [S, Hkv, L, D] (no GQA support needed, nothing repeated). q_len == ctx (fresh prefill):
    SDPA's causal mask with K/V expanded to the query heads beforehand (not timed).
    """
    from kvray.kernels.triton_attention import unified_attention

    num_q_heads, num_kv_heads, head_dim = plan.heads
    group, scale = num_q_heads // num_kv_heads, head_dim**-0.5
    b = make_paged_batch(
        [q_len] * batch, [ctx] * batch, num_kv_heads, group, head_dim, 16, plan.bench_dtype, plan.device
    )
    out = torch.empty_like(b.q)
    t = timer.median_ms(
        lambda: unified_attention(
            b.q, b.k_cache, b.v_cache, out, *b.args(), scale, max_seqlen_q=q_len, max_seqlen_k=ctx
        )
    )
    k, v = contiguous_kv(b)
    if q_len == 1:
        q = b.q.view(batch, num_kv_heads, group, head_dim)  # head h = kv_head * group + g
        causal = False
    else:
        assert q_len == ctx, "prefill timing covers fresh prompts only"
        q = b.q.view(batch, q_len, num_q_heads, head_dim).transpose(1, 2)  # [S, Hq, L, D]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        causal = True
    t_sdpa = timer.median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale))
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    dense = dense.reshape(out.shape) if q_len == 1 else dense.transpose(1, 2).reshape(out.shape)
    matches = relative_error(out, dense) < REL_TOL[plan.bench_dtype]
    return Timing(t, t_sdpa, b.kv_bytes(), matches)


def bench_decode(plan: Plan, timer: Timer) -> tuple[list[str], list[str], bool]:
    """(b) Decode rows over paged contexts: the table, the target verdict, all outputs right."""
    from kvray.kernels import triton_decode_split

    copy_bw = copy_bandwidth(plan, timer)
    sms = triton_decode_split.num_sms(plan.device)
    rows, verdict, all_match = [], [], True
    for batch in plan.decode_batches:
        for ctx in plan.decode_contexts:
            r = time_against_sdpa(plan, timer, batch, 1, ctx)
            all_match &= r.matches
            gbps = r.kv_bytes / (r.kvray_ms * 1e-3) / 1e9
            frac, ratio = gbps * 1e9 / copy_bw, r.kvray_ms / r.sdpa_ms
            splits = triton_decode_split.choose_num_splits(batch, plan.heads[1], 1, ctx, sms)
            rows.append(
                [
                    batch,
                    ctx,
                    "plain" if splits == 1 else f"split x{splits}",
                    f"{r.kvray_ms:.3f}",
                    f"{r.kv_bytes / 1e6:.1f}",
                    f"{gbps:.0f}",
                    f"{frac:.2f}",
                    f"{r.sdpa_ms:.3f}",
                    f"{ratio:.2f}",
                    "yes" if r.matches else "NO",
                ]
            )
            if (batch, ctx) == plan.target:
                where = f"batch {batch} x context {ctx}"
                verdict = [
                    f"- {where}: {frac:.2f} of copy bandwidth (want >= {COPY_TARGET}): "
                    + ("met" if frac >= COPY_TARGET else "MISSED"),
                    f"- {where}: {ratio:.2f}x contiguous SDPA time (want <= {SDPA_TARGET}): "
                    + ("met" if ratio <= SDPA_TARGET else "MISSED"),
                ]
    header = [
        "batch",
        "context",
        "path",
        "kvray ms",
        "KV MB read",
        "GB/s",
        "of copy BW",
        "SDPA ms",
        "kvray/SDPA",
        "matches SDPA",
    ]
    note = [f"Copy bandwidth (read + write) measured in this run: {copy_bw / 1e9:.0f} GB/s.", ""]
    return note + table(header, rows), verdict, all_match


def bench_prefill(plan: Plan, timer: Timer) -> tuple[list[str], bool]:
    """(c) One fresh causal prefill chunk: useful FLOPs (visible pairs only) per second; the
    table and whether kvray's output matched SDPA's."""
    num_q_heads, _, head_dim = plan.heads
    n = plan.prefill_len
    r = time_against_sdpa(plan, timer, 1, n, n)
    flops = 4 * num_q_heads * head_dim * n * (n + 1) / 2  # QK^T and PV, 2 FLOPs per MAC
    rows = [
        [
            n,
            f"{r.kvray_ms:.3f}",
            f"{flops / r.kvray_ms / 1e9:.1f}",
            f"{r.sdpa_ms:.3f}",
            f"{flops / r.sdpa_ms / 1e9:.1f}",
            f"{r.kvray_ms / r.sdpa_ms:.2f}",
            "yes" if r.matches else "NO",
        ]
    ]
    header = ["tokens", "kvray ms", "kvray TFLOP/s", "SDPA ms", "SDPA TFLOP/s", "kvray/SDPA", "matches SDPA"]
    return table(header, rows), r.matches


def writes_match_torch(name: str, plan: Plan) -> bool:
    """Triton's reshape_and_cache into an 8-bit cache against kv_quant.quantize: the same
    scales, codes within one step (fp8 writes are checked only here: the CPU tests' Triton
    interpreter rounds fp32 -> fp8 wrongly)."""
    from kvray.kernels.kv_quant import QUANTS, quantize, split_cache, within_one_step
    from kvray.kernels.triton_cache import reshape_and_cache

    _, num_kv_heads, head_dim = plan.heads
    gen = torch.Generator().manual_seed(3)
    values = (3 * torch.randn(64, num_kv_heads, head_dim, generator=gen)).to(plan.bench_dtype).to(plan.device)
    slots = torch.randperm(128, generator=gen)[:64].to(plan.device)
    storage = torch.zeros(8, 16, num_kv_heads, head_dim + 4, dtype=torch.int8, device=plan.device)
    (kc, ks), (vc, vs) = split_cache(storage, QUANTS[name]), split_cache(storage.clone(), QUANTS[name])
    reshape_and_cache(values, values, kc, vc, slots, ks, vs)
    want_codes, want_scales = quantize(values, QUANTS[name])
    ok = True
    for codes, scales in ((kc, ks), (vc, vs)):
        got_codes, got_scales = codes.flatten(0, 1)[slots], scales.flatten(0, 1)[slots]
        ok &= torch.allclose(got_scales, want_scales, rtol=1e-6, atol=0)
        ok &= within_one_step(got_codes.cpu(), want_codes.cpu())
    return bool(ok)


def bench_quantized_decode(plan: Plan, timer: Timer) -> tuple[list[str], bool]:
    """(d) Decode at the target shape over 8-bit caches (int8; fp8 e4m3 on a GPU) made from
    the same values as the model-dtype cache: time, bytes read (codes and scales) and the
    error against float64 attention over the dequantized cache; and whether the Triton
    cache writes of each 8-bit format agree with kv_quant.quantize."""
    from kvray.kernels.kv_quant import QUANTS, dequantize, quantize, split_cache
    from kvray.kernels.triton_attention import unified_attention

    num_q_heads, num_kv_heads, head_dim = plan.heads
    batch, ctx = plan.target
    group, scale = num_q_heads // num_kv_heads, head_dim**-0.5
    b = make_paged_batch(
        [1] * batch, [ctx] * batch, num_kv_heads, group, head_dim, 16, plan.bench_dtype, plan.device
    )
    names = ["auto"] + (["int8", "fp8_e4m3"] if plan.device.type == "cuda" else ["int8"])
    rows, ok, base_ms = [], True, None
    for name in names:
        out = torch.empty_like(b.q)
        if name == "auto":
            caches, scales, per_pos = (
                (b.k_cache, b.v_cache),
                (None, None),
                b.k_cache.element_size() * head_dim,
            )
            ref_b = b
        else:
            quant = QUANTS[name]
            views = []
            for values in (b.k_cache, b.v_cache):
                storage = torch.empty(
                    (*values.shape[:-1], head_dim + 4), dtype=torch.int8, device=plan.device
                )
                codes, row_scales = split_cache(storage, quant)
                codes[:], row_scales[:] = quantize(values, quant)
                views.append((codes, row_scales))
            caches, scales, per_pos = (views[0][0], views[1][0]), (views[0][1], views[1][1]), head_dim + 4
            ref_b = PagedBatchView(b, *(dequantize(c, s, plan.bench_dtype) for c, s in views))
        ms = timer.median_ms(
            lambda caches=caches, out=out, scales=scales: unified_attention(
                b.q, *caches, out, *b.args(), scale, None, *scales, max_seqlen_q=1, max_seqlen_k=ctx
            )
        )
        base_ms = base_ms or ms
        err = relative_error(out, attention_f64(ref_b, scale, None))
        writes = "—" if name == "auto" else "ok" if writes_match_torch(name, plan) else "FAIL"
        passed = err < REL_TOL[plan.bench_dtype] and writes != "FAIL"
        ok &= passed
        kv_bytes = 2 * batch * ctx * num_kv_heads * per_pos
        rows.append(
            [
                name,
                f"{ms:.3f}",
                f"{kv_bytes / 1e6:.1f}",
                f"{kv_bytes / (ms * 1e-3) / 1e9:.0f}",
                f"{ms / base_ms:.2f}",
                f"{err:.1e}",
                writes,
                "ok" if passed else "FAIL",
            ]
        )
    header = [
        "kv_cache_dtype",
        "ms",
        "KV MB read",
        "GB/s",
        "time / model dtype's",
        "rel err",
        "cache writes",
        "result",
    ]
    return [f"batch {batch} x context {ctx}, {str(plan.bench_dtype)[6:]} queries", ""] + table(
        header, rows
    ), ok


class PagedBatchView:
    """A paged batch with other caches (the dequantized values, for the reference)."""

    def __init__(self, batch, k_cache: torch.Tensor, v_cache: torch.Tensor):
        self.__dict__.update(vars(batch))
        self.k_cache, self.v_cache = k_cache, v_cache
