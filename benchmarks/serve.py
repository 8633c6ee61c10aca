"""Online serving benchmark: load on any OpenAI-compatible server, vLLM's flags and JSON.

Sends `--num-prompts` streamed requests (`stream: true`, usage in the last chunk) to
`--base-url` + `--endpoint` with aiohttp, all at once or at `--request-rate` with
gamma-distributed gaps (shape `--burstiness`; 1 is Poisson), at most `--max-concurrency`
open at a time, and reports what `vllm bench serve` reports: throughputs, goodput and
TTFT/TPOT/ITL/E2EL statistics, under vLLM's key names, with its summary table. A
comma-separated `--request-rate` sweeps (one run and one JSON per rate). This file owns
the flags, the run loop and the result; serve_client.py sends one request,
serve_datasets.py makes the prompts, serve_metrics.py the numbers, serve_plot.py the PNGs.

    kvray bench serve --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct \\
        --dataset-name mix --num-prompts 200 --request-rate 2,4,8 --save-result --plot plots
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path

import aiohttp
import numpy as np
from serve_client import RequestConfig, send_request
from serve_datasets import DATASETS, DatasetArgs, SampleRequest, WordVocab, sample_requests
from serve_metrics import (
    METRICS,
    RequestOutput,
    calculate_metrics,
    format_summary,
    output_lens,
    parse_goodput,
    select_metrics,
)
from tqdm import tqdm

from kvray.errors import InvalidArgumentError, KvrayError, check_range

DEFAULT_TOKENIZER = "smollm2-135m-instruct"
CHAT_ENDPOINT = "/v1/chat/completions"
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


def arrival_gaps(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> np.ndarray:
    """Seconds to wait after each request: 0 at rate inf, else gamma(shape=b, scale=1/(rate*b))."""
    if rate == float("inf"):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def load_benchmark_tokenizer(name: str | None):
    """`--tokenizer`: an alias or local Hugging Face folder (default: kvray's default model's)."""
    from kvray.models.loader import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(name or DEFAULT_TOKENIZER))
    if tokenizer is None:
        raise InvalidArgumentError("--tokenizer", name, "a folder holding tokenizer.json")
    return tokenizer


def request_config(args: argparse.Namespace) -> RequestConfig:
    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    if args.backend is not None and (args.backend == "openai-chat") != chat:
        raise InvalidArgumentError("--backend", args.backend, f"openai-chat exactly with {CHAT_ENDPOINT}")
    base = args.base_url.rstrip("/") if args.base_url else f"http://{args.host}:{args.port}"
    key = os.environ.get("OPENAI_API_KEY")
    return RequestConfig(
        url=base + args.endpoint,
        model=args.served_model_name or args.model,
        chat=chat,
        temperature=0.0 if args.temperature is None else args.temperature,
        ignore_eos=args.ignore_eos,
        headers={"Authorization": f"Bearer {key}"} if key else {},
    )


async def run_benchmark(args: argparse.Namespace, *, vocab: WordVocab | None = None) -> dict:
    """One run at a single `args.request_rate`; returns the result dict (what --save-result writes)."""
    check_args(args)
    rate = args.request_rate[0] if isinstance(args.request_rate, list) else args.request_rate
    if isinstance(args.request_rate, list) and len(args.request_rate) != 1:
        raise InvalidArgumentError("--request-rate", args.request_rate, "one rate per run (main sweeps)")
    goodput = parse_goodput(args.goodput)
    cfg = request_config(args)
    vocab = vocab or WordVocab(load_benchmark_tokenizer(args.tokenizer))
    requests = sample_requests(args.dataset_name, dataset_args(args), vocab)
    gaps = arrival_gaps(np.random.default_rng([args.seed, 1]), len(requests), rate, args.burstiness)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(requests), disable=args.disable_tqdm)

    # a connection per request: a pooled one the server has closed meanwhile (llama.cpp's
    # server drops keep-alive connections idle for 5 s) fails the next request sent on it
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT, connector=connector) as s:

        async def one(sample: SampleRequest) -> RequestOutput:
            if limit is None:
                out = await send_request(s, cfg, sample)
            else:
                async with limit:
                    out = await send_request(s, cfg, sample)
            bar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for sample, gap in zip(requests, gaps):
            tasks.append(asyncio.create_task(one(sample)))
            if gap > 0:
                await asyncio.sleep(gap)
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()

    lens = output_lens(outputs, vocab.count)
    metrics = calculate_metrics(outputs, lens, duration, args.metric_percentiles, goodput)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend or ("openai-chat" if cfg.chat else "openai"),
        "model_id": args.model,
        "tokenizer_id": args.tokenizer or DEFAULT_TOKENIZER,
        "num_prompts": args.num_prompts,
        "request_rate": rate if rate < float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **select_metrics(metrics, args.percentile_metrics, args.metric_percentiles),
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "e2els": [o.e2el for o in outputs],  # not in vLLM's JSON: the E2EL CDF of --plot needs it
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    return result


def dataset_args(args: argparse.Namespace) -> DatasetArgs:
    return DatasetArgs(
        num_prompts=args.num_prompts,
        seed=args.seed,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len,
        shared_prefix_num_groups=args.shared_prefix_num_groups,
        shared_prefix_len=args.shared_prefix_len,
        sharegpt_output_len=args.sharegpt_output_len,
    )


def result_path(args: argparse.Namespace, result: dict, sweep: bool) -> Path:
    """vLLM's `{backend}-{rate}qps[-concurrency{n}]-{model}-{date}.json`, or --result-filename
    (with `-{rate}qps` before the suffix in a sweep, one file per rate)."""
    rate = float(result["request_rate"])
    if args.result_filename:
        name = Path(args.result_filename)
        if sweep:
            name = name.with_name(f"{name.stem}-{rate}qps{name.suffix}")
    else:
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        model = args.model.split("/")[-1]
        name = Path(f"{result['backend']}-{rate}qps{conc}-{model}-{result['date']}.json")
    return Path(args.result_dir) / name if args.result_dir else name


def _csv(kind, name: str):
    def parse(text: str) -> list:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: a comma-separated list, got {text!r}") from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvray bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["vllm", "openai", "openai-chat"], default=None)
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (else --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions", help=f"or {CHAT_ENDPOINT}")
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name", default=None, help="the `model` sent (default: --model)")
    p.add_argument(
        "--tokenizer", default=None, help=f"alias or local HF folder (default {DEFAULT_TOKENIZER})"
    )
    p.add_argument("--dataset-name", choices=sorted(DATASETS), default="random")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--shared-prefix-num-groups", type=int, default=8)
    p.add_argument("--shared-prefix-len", type=int, default=1024)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument(
        "--request-rate",
        type=_csv(float, "--request-rate"),
        default=[float("inf")],
        help="requests/s (inf: all at once); a comma-separated list sweeps",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=None, help="default 0 (greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--percentile-metrics", type=_csv(str, "--percentile-metrics"), default=["ttft", "tpot", "itl"]
    )
    p.add_argument("--metric-percentiles", type=_csv(float, "--metric-percentiles"), default=[99.0])
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="ttft:MS tpot:MS e2el:MS")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--plot", default=None, metavar="DIR", help="latency CDFs (and sweep curves) as PNGs")
    return p


def check_args(args: argparse.Namespace) -> None:
    for name in args.percentile_metrics:
        if name not in METRICS:
            raise InvalidArgumentError("--percentile-metrics", name, f"names from {list(METRICS)}")
    for p in args.metric_percentiles:
        check_range("--metric-percentiles", p, low=0.0, high=100.0, low_open=True)
    for rate in args.request_rate if isinstance(args.request_rate, list) else [args.request_rate]:
        check_range("--request-rate", rate, low=0.0, low_open=True, allow_inf=True)
    check_range("--burstiness", args.burstiness, low=0.0, low_open=True)
    if args.max_concurrency is not None:
        check_range("--max-concurrency", args.max_concurrency, low=1)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        if args.plot:
            from serve_plot import plot_run, plot_sweep, require_matplotlib

            require_matplotlib()
        vocab = WordVocab(load_benchmark_tokenizer(args.tokenizer))
        results = []
        for rate in args.request_rate:
            print(f"Traffic request rate: {rate}\nBurstiness factor: {args.burstiness}")
            print(f"Maximum request concurrency: {args.max_concurrency}")
            run_args = argparse.Namespace(**{**vars(args), "request_rate": rate})
            result = asyncio.run(run_benchmark(run_args, vocab=vocab))
            print(format_summary(result, args.percentile_metrics, args.metric_percentiles))
            if errors := sorted({e for e in result["errors"] if e}):
                print(f"kvray: {result['failed']} requests failed, e.g. {errors[:3]}", file=sys.stderr)
            if args.save_result:
                path = result_path(args, result, sweep=len(args.request_rate) > 1)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(result))
                print(f"saved {path}")
            if args.plot:
                print(f"plotted {plot_run(result, Path(args.plot))}")
            results.append(result)
        if args.plot and len(results) > 1:
            print(f"plotted {plot_sweep(results, Path(args.plot))}")
    except KvrayError as e:
        print(f"kvray: error: {e}", file=sys.stderr)
        return 2
    return 0 if all(r["completed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
