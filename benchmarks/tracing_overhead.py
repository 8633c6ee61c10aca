"""What request tracing costs a served app: the same load through `kvray serve` with
tracing off (no `otlp_traces_endpoint`: nothing imported, nothing recorded), on (every
request's spans exported to an OTLP/HTTP receiver this process runs, on the same machine),
and, with `--baseline-src`, from a kvray tree without tracing at all (what "off" must
match). Rows interleave over `--rounds`; the table shows medians and each round's ratio to
that round's tracing-off row.

    python benchmarks/tracing_overhead.py [--preset smollm2-cpu-pd] [--rounds 2]
        [--baseline-src DIR] [--num-prompts 32] [--max-concurrency 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import yaml
from otlp_receiver import OTLPReceiver
from serve_harness import Server, cpu_banner, run_load

from kvray.router.ingress_parts import load_config


def config_file(preset: str, endpoint: str | None) -> str:
    config = load_config(preset).model_dump(exclude_defaults=True)
    if endpoint is not None:
        config["otlp_traces_endpoint"] = endpoint
    path = Path(tempfile.mkdtemp(prefix="kvray-trace-bench-")) / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def load_args(args, seed: int, num_prompts: int) -> list[str]:
    return [
        "--dataset-name", "mix", "--num-prompts", str(num_prompts), "--seed", str(seed),
        "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="smollm2-cpu-pd")
    parser.add_argument("--baseline-src", default=None, help="a kvray tree without tracing")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    receiver = OTLPReceiver()
    model = load_config(args.preset).model_name
    rows = [("tracing off", None, None), ("tracing on (OTLP/HTTP, local receiver)", receiver.endpoint, None)]
    if args.baseline_src:
        rows.append(("baseline tree (no tracing code)", None, args.baseline_src))
    results: dict[str, list[dict]] = {name: [] for name, _, _ in rows}
    for n in range(args.rounds):
        seed = args.seed + 2 * n
        for name, endpoint, src in rows:
            config = config_file(args.preset, endpoint)
            with Server(config, src, log=f"/tmp/kvray-trace-bench-{n}.log") as server:
                run_load(server.url, model, load_args(args, seed + 1, args.max_concurrency))  # warm-up
                results[name].append(run_load(server.url, model, load_args(args, seed, args.num_prompts)))
            r = results[name][-1]
            print(f"round {n + 1}: {name}: {r['output_throughput']:.1f} tok/s", flush=True)
    receiver.close()

    off = [r["output_throughput"] for r in results["tracing off"]]
    print(f"\n{cpu_banner()}")
    print(f"`kvray serve` {args.preset}; load: {args.num_prompts} requests, mix, ignore_eos, streamed, "
          f"{args.max_concurrency} clients; {args.rounds} round(s), medians; "
          f"spans received: {len(receiver.spans)}\n")  # fmt: skip
    print("| what | useful tok/s | vs tracing off | TTFT p50 | ITL p50 | ITL p99 |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        tok = [r["output_throughput"] for r in runs]
        ratios = [t / o for t, o in zip(tok, off)]
        each = f" ({' / '.join(f'{x:.3f}' for x in ratios)})" if len(ratios) > 1 else ""
        print(
            f"| {name} | {statistics.median(tok):.1f} | {statistics.median(ratios):.3f}{each} | "
            f"{statistics.median(r['median_ttft_ms'] for r in runs) / 1e3:.2f} s | "
            f"{statistics.median(r['median_itl_ms'] for r in runs):.0f} ms | "
            f"{statistics.median(r['p99_itl_ms'] for r in runs):.0f} ms |"
        )


if __name__ == "__main__":
    main()
