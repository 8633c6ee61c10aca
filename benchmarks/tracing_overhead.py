"""What request tracing costs a served app: the same load through `kvray serve` with
tracing off (no `otlp_traces_endpoint`: nothing imported, nothing recorded), on (every
request's spans exported to an OTLP/HTTP receiver this process runs, on the same machine),
and, with `--baseline-src`, from a kvray tree without tracing at all (what "off" must
match). Rows interleave over `--rounds`; the table shows medians and each round's ratio to
that round's tracing-off row. First, in this process, the CPU a traced request's spans
cost (its root and the eight spans of a disaggregated request, recorded and exported to
the receiver), which a served run's noise (10 % between minutes on a shared VM) hides.

    python benchmarks/tracing_overhead.py [--preset smollm2-cpu-pd] [--rounds 2]
        [--baseline-src DIR] [--num-prompts 32] [--max-concurrency 16] [--spans-only]
"""

from __future__ import annotations

import argparse
import statistics
import time

from otlp_receiver import OTLPReceiver
from serve_harness import Server, cpu_banner, preset_file
from served_vs_offline import served

from kvray.router.ingress_parts import load_config


def span_cost(endpoint: str, requests: int = 200) -> tuple[float, float]:
    """CPU microseconds per traced request: the ingress's root with its attributes and the
    spans every process of a disaggregated request records (on the recording thread; then
    the process's, the exporter's thread and this process's receiver included: an upper
    bound). 220 requests' spans fit the exporter's queue (2,048 spans): none dropped."""
    from kvray.tracing import Tracing

    tracing = Tracing(endpoint, "bench")
    start, start_thread = 0.0, 0.0
    for i in range(requests + 20):
        if i == 20:  # the first ones import and warm up: not counted
            start, start_thread = time.process_time(), time.thread_time()
        trace = tracing.request({}, {"gen_ai.request.id": "cmpl-x", "gen_ai.request.max_tokens": 64})
        now = time.time_ns()
        for name in ("ingress", "route", "route", "queue", "prefill", "kv_pull", "decode", "finish"):
            trace.record(name, now, now + 1000, {"kvray.role": "decode"})
        trace.first_token()
        trace.end()
    recording = (time.thread_time() - start_thread) / requests * 1e6
    tracing.shutdown()  # the exporter's work counts too
    return recording, (time.process_time() - start) / requests * 1e6


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
    parser.add_argument("--spans-only", action="store_true", help="only the per-request span cost")
    args = parser.parse_args()

    receiver = OTLPReceiver()
    recording, total = span_cost(receiver.endpoint)
    print(
        f"spans of one traced request: {recording:.0f} us of CPU to record, {total:.0f} us with "
        "exporting and receiving them",
        flush=True,
    )
    if args.spans_only:
        return
    model = load_config(args.preset).model_name
    rows = [("tracing off", None, None), ("tracing on (OTLP/HTTP, local receiver)", receiver.endpoint, None)]
    if args.baseline_src:
        rows.append(("baseline tree (no tracing code)", None, args.baseline_src))
    results: dict[str, list[dict]] = {name: [] for name, _, _ in rows}
    for n in range(args.rounds):
        seed = args.seed + 2 * n
        for name, endpoint, src in rows:

            def trace_to(config: dict, endpoint=endpoint) -> None:
                if endpoint is not None:  # (a baseline tree may not know the field)
                    config["otlp_traces_endpoint"] = endpoint

            config = preset_file(args.preset, trace_to, f"trace-{args.preset}-{n}")
            with Server(config, src, log=f"/tmp/kvray-trace-bench-{n}.log") as server:
                results[name].append(served(server.url, model, args, seed))  # (its warm-up first)
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
