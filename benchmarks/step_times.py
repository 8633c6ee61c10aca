"""Measured step times of kvray's engine on this machine, and the simulator's fit to them.

Runs the real engine (SmolLM2, `dtype=auto`) over prompt-only steps, decode batches and
chunked prefills mixed with decodes, records each step's batch as the scheduler handed it
out (per request: new tokens, context, whether it samples) and its wall time
(`LLMEngine.step`: schedule, forward, sampling, outputs), measures the machine's matmul
rate and memory bandwidth in the same run, fits `kvray.sim.cost_model.StepTimeModel` and
writes everything to a JSON the simulator reads (`kvray sim --step-times FILE`).

    kvray bench step-times [--threads N] [--out sim/profiles/cpu-tN.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from offline_throughput import best_matmul_rate
from serve_harness import cpu_banner
from single_stream import read_bandwidth

from kvray.sim.cost_model import Hardware, ModelSpec, StepSample, StepTimeModel, fit, median, relative_errors
from kvray.sim.worker import batch_of

PROFILES = Path(__file__).resolve().parent.parent / "sim" / "profiles"  # what `kvray sim` reads


def shapes(quick: bool) -> list[tuple[str, list[int], int]]:
    """(name, prompt lengths, output tokens) of each run."""
    prefills = [16, 64, 128, 256, 512] if not quick else [32, 256]
    batches = [1, 4, 8, 16, 32] if not quick else [2, 8]
    runs = [(f"prefill {p}", [p], 2) for p in prefills]
    runs += [
        (f"decode x{b}", [96 + 160 * (i % 3) for i in range(b)], 12 if not quick else 6) for b in batches
    ]
    runs += [("long context x4", [900, 1000, 1100, 1200], 8 if not quick else 3)]
    return runs


def measure(llm, runs, seed: int = 0) -> list[tuple[str, StepSample]]:
    """Every step of every run, with its batch and seconds."""
    from kvray.engine import SamplingParams

    engine = llm.engine
    rng = random.Random(seed)
    vocab = engine.hf_config.vocab_size
    schedule = engine.scheduler.schedule
    seen: list = []

    def recording_schedule():
        out = schedule()
        seen.append(batch_of(out))
        return out

    engine.scheduler.schedule = recording_schedule
    samples = []
    try:
        for name, prompts, new_tokens in runs:
            params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
            for i, n in enumerate(prompts):
                ids = [rng.randrange(100, vocab) for _ in range(n)]
                engine.add_request(f"{name}-{i}", {"prompt_token_ids": ids}, params)
            while engine.has_unfinished_requests():
                seen.clear()
                start = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - start
                if seen and seen[-1]:
                    samples.append((name, StepSample(tuple(seen[-1]), seconds)))
    finally:
        engine.scheduler.schedule = schedule
    return samples


def kind(s: StepSample) -> str:
    """A step's group in the table: decode-only, prompt-only or mixed, by batch size."""
    decodes = sum(1 for w in s.batch if w.num_new_tokens == 1)
    what = "decode" if decodes == len(s.batch) else "prefill" if decodes == 0 else "mixed"
    size = len(s.batch)
    bucket = "1" if size == 1 else "2-4" if size <= 4 else "5-16" if size <= 16 else "17+"
    tokens = sum(w.num_new_tokens for w in s.batch)
    return f"{what} x{bucket}" + (
        "" if what == "decode" else f", {'<=128' if tokens <= 128 else '>128'} tokens"
    )


def from_trace(folder: Path, profile_dir: Path = PROFILES) -> tuple[int, list[tuple[str, StepSample]]]:
    """(torch threads, steps) of the trace files a served engine wrote (`engine:
    step_trace_dir`), each file's first steps left out (first-call costs)."""
    threads, samples = None, []
    files = sorted(folder.glob("steps-*.jsonl"))
    if not files:
        raise SystemExit(f"no steps-*.jsonl in {folder}")
    for path in files:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        meta, steps = lines[0], lines[1:]
        if threads not in (None, meta["threads"]):
            raise SystemExit(f"{path}: {meta['threads']} threads, other files {threads}")
        threads = meta["threads"]
        samples += [(path.stem, StepSample.from_dict(d)) for d in steps[3:]]
    return threads, samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, the cores)")
    ap.add_argument("--out", type=Path, default=None, help="default: sim/profiles/cpu-t<threads>.json")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    ap.add_argument(
        "--from-trace",
        type=Path,
        default=None,
        metavar="DIR",
        help="fit the steps a served engine traced there (its machine peaks from sim/profiles/cpu-t<N>.json)",
    )
    ap.add_argument(
        "--from-gpu",
        type=Path,
        default=None,
        metavar="FILE",
        help="fit the steps gpu_check.py timed (results/gpu_step_times.json) to the GPU's datasheet peaks",
    )
    ap.add_argument(
        "--gpu", default=None, help="its kvray.sim.cost_model.HARDWARE name (default: from the device)"
    )
    args = ap.parse_args()
    if args.from_gpu is not None:
        fit_gpu(args.from_gpu, args.gpu, args.out)
        return
    if args.from_trace is not None:
        fit_trace(args.from_trace, args.out)
        return

    from kvray.engine import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or PROFILES / f"cpu-t{torch.get_num_threads()}.json"
    banner = cpu_banner()
    print(banner)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=False,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=64,
        max_model_len=2048,
        quantization_ignore=["*"],  # the weights in `dtype`, as the fitted ModelSpec counts their bytes
    )
    engine = llm.engine
    dtype = engine.dtype
    print(f"dtype: {str(dtype).removeprefix('torch.')}, threads: {torch.get_num_threads()}")
    measure(llm, shapes(quick=True)[:1])  # warm-up: first-call costs stay out of the fit
    samples = measure(llm, shapes(args.quick))
    peak, where = best_matmul_rate(engine.hf_config, dtype)
    bandwidth = read_bandwidth(torch.ones((1 << 28) // 4))  # 256 MiB, far larger than the caches
    print(f"matmul peak {peak / 1e9:.1f} GFLOP/s ({where}); read bandwidth {bandwidth / 1e9:.1f} GB/s")
    llm.close()

    elem = torch.tensor([], dtype=dtype).element_size()
    model = ModelSpec.from_hf_config("smollm2-135m", engine.hf_config.to_dict(), dtype_bytes=elem)
    # the gloo pull between two worker processes on one machine (DESIGN.md: about 2.2 GB/s)
    cpu = Hardware("cpu", peak, bandwidth, 24e9, 2.2e9, 1e-3)
    fitted = fit([s for _, s in samples], model, cpu, source=f"fitted to {len(samples)} steps: {banner}")
    report(
        fitted,
        samples,
        out,
        {"machine": banner, "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads()},
    )


def fit_trace(folder: Path, out: Path | None) -> None:
    threads, samples = from_trace(folder)
    offline = json.loads((PROFILES / f"cpu-t{threads}.json").read_text())
    base = StepTimeModel.from_dict(offline["fit"])
    source = f"fitted to {len(samples)} served steps ({folder.name}): {offline['machine']}"
    fitted = fit([s for _, s in samples], base.model, base.hardware, source=source)
    meta = {"machine": offline["machine"], "dtype": offline["dtype"], "threads": threads, "served": True}
    report(fitted, samples, out or PROFILES / f"cpu-t{threads}-served.json", meta)


def fit_gpu(path: Path, gpu: str | None, out: Path | None) -> None:
    """The step-time model of a lent GPU, from the steps `gpu_check.py` timed there."""
    from kvray.sim.cost_model import HARDWARE

    d = json.loads(path.read_text())
    name = gpu or next((n for n in HARDWARE if n in d["device"]), None)
    if name not in HARDWARE:
        raise SystemExit(f"which GPU is {d['device']!r}? pass --gpu (one of {', '.join(HARDWARE)})")
    model = ModelSpec.from_hf_config("gpu-check-llama", d["hf_config"], dtype_bytes=d["dtype_bytes"])
    samples = [("gpu_check", StepSample.from_dict(x)) for x in d["samples"]]
    fitted = fit(
        [s for _, s in samples],
        model,
        HARDWARE[name],
        source=f"fitted to {len(samples)} steps: {d['device']}",
    )
    meta = {"machine": d["device"], "dtype_bytes": d["dtype_bytes"], "threads": 0}
    report(fitted, samples, out or PROFILES / f"gpu-{name}.json", meta)


def report(fitted: StepTimeModel, samples: list[tuple[str, StepSample]], out: Path, meta: dict) -> None:
    """Print the fit and its error by kind of step; write the profile JSON."""
    errors = relative_errors(fitted, [s for _, s in samples])
    print(
        f"fit: eff_compute {fitted.eff_compute:.2f}, eff_memory {fitted.eff_memory:.2f}, "
        f"eff_attention {fitted.eff_attention:.2f}, overhead {fitted.overhead_s * 1e3:.1f} ms "
        f"+ {fitted.per_seq_s * 1e3:.2f} ms/seq; "
        f"median error {median(errors):.1%}"
    )
    print("\n| steps | count | measured ms (median) | predicted ms (median) | median error |")
    print("|---|---|---|---|---|")
    groups: dict[str, list[StepSample]] = {}
    for _, s in samples:
        groups.setdefault(kind(s), []).append(s)
    for name, ss in sorted(groups.items()):
        meas = median([s.seconds for s in ss]) * 1e3
        pred = median([fitted.predict(s.batch) for s in ss]) * 1e3
        print(f"| {name} | {len(ss)} | {meas:.1f} | {pred:.1f} | {median(relative_errors(fitted, ss)):.1%} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                **meta,
                "samples": [{"run": name, **s.to_dict()} for name, s in samples],
                "fit": fitted.to_dict(),
                "median_error": median(errors),
            },
            separators=(",", ":"),  # compact: the profiles ship in the package
        )
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
