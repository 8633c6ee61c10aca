"""Served against offline: the same load through `kvray serve` (each preset) and through the
offline engine, in one run, plus any other OpenAI-compatible servers (llama.cpp, vLLM).

Load (kvray's reference mix, `kvray bench serve --dataset-name mix`): 32 requests, prompts
32-384 tokens of English words, outputs 16-160 tokens, ignore_eos, greedy, streamed, 16
concurrent clients. Offline: `LLM.generate` on the same prompts with 2 torch threads.
Useful tok/s = the output tokens the requests asked for / wall time. Every engine first
runs `--max-concurrency` other prompts of the mix (seed + 1) at that concurrency, so no
measured prompt finds its prefix cached and every slot of a server has run once
(llama.cpp's server runs a slot's first request at about half speed). Round n draws its
prompts with seed + 2n and its warm-up with seed + 2n + 1: a server that outlives the
rounds (llama.cpp, vLLM: both cache prompts) must not find the last round's prompts. For a kvray server it
also prints how many measured prompts were prefilled on a decode worker
(`kvray:local_prefills_total`, `router.max_local_prefill_length`), recomputed there
instead of pulled (`kvray:kv_recompute_total`: a decode worker whose KV cache had no room)
and preempted (`kvray:num_preemptions_total`).

    python benchmarks/served_vs_offline.py [--presets smollm2-cpu,smollm2-cpu-pd]
        [--baseline-src DIR]              # also serve the presets from another kvray tree
        [--external NAME=URL[@MODEL] ...] # e.g. llama.cpp=http://127.0.0.1:8091
        [--rounds N]                      # N rounds, each every row afresh: medians
        [--model ALIAS]                   # another model: offline, and each preset with it
        [--save FILE.json]

A shared VM's speed drifts 10-30 % between minutes (BENCHMARKS.md), so with `--rounds N`
every row runs N times, interleaved (round 1: offline, capped, each server; round 2: the
same ...), each ratio is taken within its round, and the table shows the medians with
every round's ratio beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path

import torch
from serve_datasets import DatasetArgs, WordVocab, sample_requests
from serve_harness import Server, cpu_banner, preset_file, run_load

MODEL = "smollm2-135m-instruct"


def with_model(preset: str, model: str) -> str:
    """`preset` serving `model` instead of its own: a YAML file beside the logs (`preset`
    itself when it already serves `model`)."""
    from kvray.router.app import load_config

    if load_config(preset).engine.get("model") == model:
        return preset

    def serve_model(config: dict) -> None:
        config.setdefault("engine", {})["model"] = config["model_name"] = model

    return preset_file(preset, serve_model, f"{Path(preset).stem}-{model}")


def offline(model: str, requests, warm_up, threads: int, max_num_seqs: int | None = None) -> float:
    """Useful tok/s of `LLM.generate` on `requests`, after a run of `warm_up` (other prompts:
    the measured ones must not find their prefixes cached, as the served runs do not).
    `max_num_seqs`: how many run at once (None: the engine's default, which takes them all)."""
    from kvray.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    at_once = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    llm = LLM(model=model, dtype="auto", max_model_len=2048, **at_once)  # as the presets: bf16 where native

    def params(rs):
        return [
            SamplingParams(temperature=0.0, max_tokens=r.expected_output_len, ignore_eos=True) for r in rs
        ]

    llm.generate([r.prompt for r in warm_up], params(warm_up))
    start = time.perf_counter()
    llm.generate([r.prompt for r in requests], params(requests))
    return sum(r.expected_output_len for r in requests) / (time.perf_counter() - start)


def bench_args(args, seed: int | None = None) -> list[str]:
    seed = args.seed if seed is None else seed
    return [
        "--dataset-name", "mix", "--num-prompts", str(args.num_prompts), "--seed", str(seed),
        "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
    ]  # fmt: skip


# kvray's counters read around each measured run: result key -> metric
COUNTERS = {
    "local_prefills": "kvray:local_prefills_total",  # PD: prompts prefilled on a decode worker
    "kv_recomputes": "kvray:kv_recompute_total",  # PD: prompts a decode worker recomputed
    "preemptions": "kvray:num_preemptions_total",
}


def counters(url: str) -> dict[str, float] | None:
    """kvray's COUNTERS on url's /metrics, each summed over its labels (None: another server)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    found: dict[str, float] = {}
    for key, name in COUNTERS.items():
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
        if values:
            found[key] = sum(values)
    return found or None


def served(url: str, model: str, args, seed: int) -> dict:
    warm = [
        "--dataset-name", "mix", "--num-prompts", str(args.max_concurrency), "--seed", str(seed + 1),
        "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--disable-tqdm",
    ]  # fmt: skip
    run_load(url, model, warm)  # the offline run's warm-up prompts
    before = counters(url)
    result = run_load(url, model, bench_args(args, seed))
    after = counters(url)
    if before is not None and after is not None:
        result.update({k: int(after[k] - before.get(k, 0)) for k in after})
    return result


def row(name: str, r: dict, base: float) -> str:
    tput = r["output_throughput"]
    return (
        f"| {name} | {tput:.1f} | {tput / base:.2f} | {r['median_ttft_ms'] / 1e3:.2f} s | "
        f"{r['median_itl_ms']:.0f} ms | {r['p99_itl_ms']:.0f} ms | {r['completed']}/{r['num_prompts']} |"
    )


def summary_row(name: str, tok_s: list[float], bases: list[float], latency: list[dict] | None = None) -> str:
    """A row of medians over the rounds, each round's ratio (to its own offline run) beside."""
    ratios = [t / b for t, b in zip(tok_s, bases)]
    each = f" ({' / '.join(f'{r:.2f}' for r in ratios)})" if len(ratios) > 1 else ""
    lat = "— | — | — | —"
    if latency:
        lat = (
            f"{statistics.median([r['median_ttft_ms'] for r in latency]) / 1e3:.2f} s | "
            f"{statistics.median([r['median_itl_ms'] for r in latency]):.0f} ms | "
            f"{statistics.median([r['p99_itl_ms'] for r in latency]):.0f} ms | "
            f"{sum(r['completed'] for r in latency)}/{sum(r['num_prompts'] for r in latency)}"
        )
    middle = statistics.median(ratios)
    return f"| {name} | {statistics.median(tok_s):.1f} | **{middle:.2f}**{each} | {lat} |"


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default=MODEL, help="an alias: offline, and every preset serving it")
    parser.add_argument("--presets", default="smollm2-cpu,smollm2-cpu-pd")
    parser.add_argument("--baseline-src", default=None)
    parser.add_argument("--external", nargs="*", default=[])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="run every row this many times, interleaved")
    parser.add_argument("--save", default=None)
    parser.add_argument("--offline-tok-s", type=float, default=None, help="skip the offline run: use this")
    args = parser.parse_args()

    from kvray.models.loader import load_tokenizer, resolve_model_path

    vocab = WordVocab(load_tokenizer(resolve_model_path(args.model)))
    bases: list[float] = []
    capped: list[float] = []
    results: dict[str, list[dict]] = {}
    servers = [
        (f"{label} serve {preset}", with_model(preset, args.model), src)
        for preset in args.presets.split(",")
        if preset
        for label, src in (("kvray", None), ("baseline", args.baseline_src))
        if label == "kvray" or src
    ]
    for n in range(args.rounds):
        print(f"round {n + 1} of {args.rounds}", flush=True)
        seed = args.seed + 2 * n  # this round's prompts (seed + 1: its warm-up's)
        requests = sample_requests("mix", DatasetArgs(num_prompts=args.num_prompts, seed=seed), vocab)
        warm_up = sample_requests("mix", DatasetArgs(num_prompts=args.max_concurrency, seed=seed + 1), vocab)
        bases.append(args.offline_tok_s or offline(args.model, requests, warm_up, args.threads))
        print(f"offline ({args.threads} threads): {bases[-1]:.1f} useful tok/s", flush=True)
        # the same engine held to the clients' concurrency: how much of the gap that alone is
        if not args.offline_tok_s:
            capped.append(offline(args.model, requests, warm_up, args.threads, args.max_concurrency))
        for name, preset, src in servers:
            label = name.split()[0]
            with Server(preset, src, log=f"/tmp/kvray-bench-{label}-{Path(preset).stem}.log") as server:
                results.setdefault(name, []).append(served(server.url, args.model, args, seed))
            print(row(name, results[name][-1], bases[-1]), flush=True)
        for spec in args.external:
            name, _, rest = spec.partition("=")
            url, _, model = rest.partition("@")
            results.setdefault(name, []).append(served(url, model or args.model, args, seed))
            print(row(name, results[name][-1], bases[-1]), flush=True)

    from kvray.engine.dtype import resolve_dtype

    dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    print(f"\n{cpu_banner()}; torch {torch.__version__}; {args.model}, dtype auto -> {dtype}")
    print(f"load: {args.num_prompts} requests, mix (prompts 32-384, outputs 16-160), ignore_eos, greedy, "
          f"streamed, {args.max_concurrency} concurrent clients, seed {args.seed} + 2 x round; "
          f"{args.rounds} round(s), medians"
          f"{' (each round in brackets)' if args.rounds > 1 else ''}\n")  # fmt: skip
    print("| what | useful tok/s | vs offline | TTFT p50 | ITL p50 | ITL p99 | completed |")
    print("|---|---|---|---|---|---|---|")
    print(summary_row(f"kvray offline `LLM.generate`, {args.threads} threads", bases, bases))
    if capped:
        print(
            summary_row(
                f"the same, `max_num_seqs={args.max_concurrency}` (the clients' concurrency)", capped, bases
            )
        )
    for name, runs in results.items():
        print(summary_row(name, [r["output_throughput"] for r in runs], bases, runs))
    for name, runs in results.items():
        said = [
            f"{' / '.join(str(r.get(key, 0)) for r in runs)} {what}"
            for key, what in (
                ("local_prefills", "prompts prefilled on the decode worker"),
                ("kv_recomputes", "prompts recomputed on the decode worker (not pulled)"),
                ("preemptions", "preemptions"),
            )
            if any(r.get(key) for r in runs)
        ]
        if said:
            print(f"\n{name}, of {runs[0]['num_prompts']} requests a round: " + "; ".join(said))
    if args.save:
        slim = {
            k: [{m: v for m, v in r.items() if not isinstance(v, list)} for r in runs]
            for k, runs in results.items()
        }
        with open(args.save, "w") as f:
            saved = {
                "offline_tok_s": bases,
                "offline_capped_tok_s": capped,
                "runs": slim,
                "cpu": cpu_banner(),
            }
            json.dump(saved, f, indent=1)


if __name__ == "__main__":
    main()
