"""Metrics of `kvray bench serve`, computed as vLLM's `vllm bench serve` computes them.

Per request: TTFT (first chunk carrying text), ITL (gaps between chunks carrying text),
E2EL (request sent to stream closed) and TPOT = (E2EL - TTFT) / (output_tokens - 1) for
requests with more than one output token. Per run: throughputs over the wall-clock
duration, and request goodput = completed requests meeting every `--goodput` SLO per
second. Percentiles are numpy's (linear interpolation); times are stored in seconds and
reported in milliseconds under vLLM's key names (`mean_ttft_ms`, `p99_itl_ms`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvray.errors import InvalidArgumentError

METRICS = {  # name -> (label, header) of vLLM's summary table, in its order
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestOutput:
    """One request's record, filled in by the client as the stream arrives."""

    prompt_len: int = 0  # the dataset's token count of the prompt
    success: bool = False  # the stream ended normally and carried text
    error: str = ""  # why it failed; "" on success
    output_tokens: int | None = None  # usage.completion_tokens when the server sent usage
    ttft: float = 0.0  # seconds from send to the first chunk with non-empty text
    itl: list[float] = field(default_factory=list)  # seconds between later chunks with text
    e2el: float = 0.0  # seconds from send to the end of the stream
    generated_text: str = ""


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise InvalidArgumentError("--goodput", item, f"NAME:MS with NAME one of {GOODPUT_METRICS}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise InvalidArgumentError("--goodput", item, "a number of milliseconds after ':'") from None
        if slos[name] < 0:
            raise InvalidArgumentError("--goodput", item, "a non-negative number of milliseconds")
    return slos


def p_word(p: float) -> str:
    """vLLM's percentile spelling in keys and labels: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def output_lens(outputs: list[RequestOutput], count_tokens) -> list[int]:
    """Output tokens per request: the server's usage count, else the tokenizer's; 0 if failed."""
    lens = []
    for o in outputs:
        if not o.success:
            lens.append(0)
        elif o.output_tokens is not None:
            lens.append(o.output_tokens)
        else:
            lens.append(count_tokens(o.generated_text))
    return lens


def tpot(o: RequestOutput, num_tokens: int) -> float | None:
    return (o.e2el - o.ttft) / (num_tokens - 1) if num_tokens > 1 else None


def calculate_metrics(
    outputs: list[RequestOutput],
    lens: list[int],
    duration: float,
    percentiles: list[float],
    goodput: dict[str, float],
) -> dict:
    """The run's aggregate numbers under vLLM's result keys (all metrics, every percentile)."""
    done = [(o, n) for o, n in zip(outputs, lens) if o.success]
    samples = {
        "ttft": [o.ttft for o, _ in done],
        "tpot": [t for o, n in done if (t := tpot(o, n)) is not None],
        "itl": [gap for o, _ in done for gap in o.itl],
        "e2el": [o.e2el for o, _ in done],
    }
    total_input = sum(o.prompt_len for o, _ in done)
    total_output = sum(lens)
    result = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
    }
    if goodput:
        result["request_goodput"] = sum(meets_slos(o, n, goodput) for o, n in done) / duration
    result["output_throughput"] = total_output / duration
    result["total_token_throughput"] = (total_input + total_output) / duration
    for name, values in samples.items():
        ms = np.asarray(values or [0.0]) * 1000
        result[f"mean_{name}_ms"] = float(np.mean(ms))
        result[f"median_{name}_ms"] = float(np.median(ms))
        result[f"std_{name}_ms"] = float(np.std(ms))
        for p in percentiles:
            result[f"p{p_word(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return result


def meets_slos(o: RequestOutput, num_tokens: int, slos_ms: dict[str, float]) -> bool:
    """vLLM's goodput test; a request with one output token has TPOT 0."""
    values = {"ttft": o.ttft, "tpot": tpot(o, num_tokens) or 0.0, "e2el": o.e2el}
    return all(values[name] * 1000 <= slo for name, slo in slos_ms.items())


def select_metrics(result: dict, metrics: list[str], percentiles: list[float]) -> dict:
    """Drops the latency keys of metrics not in `--percentile-metrics`, as vLLM's JSON does."""
    dropped = {
        key
        for name in METRICS
        if name not in metrics
        for key in (f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms")
        + tuple(f"p{p_word(p)}_{name}_ms" for p in percentiles)
    }
    return {k: v for k, v in result.items() if k not in dropped}


def format_summary(result: dict, metrics: list[str], percentiles: list[float]) -> str:
    """vLLM's "Serving Benchmark Result" table."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value, fmt: str = "") -> None:
        lines.append("{:<40} {:<10{fmt}}".format(label, value, fmt=fmt))

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    if result.get("request_rate", "inf") != "inf":
        row("Request rate configured (RPS):", result["request_rate"], ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if "request_goodput" in result:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for name, (label, header) in METRICS.items():
        if name not in metrics:
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {label} (ms):", result[f"mean_{name}_ms"], ".2f")
        row(f"Median {label} (ms):", result[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            row(f"P{p_word(p)} {label} (ms):", result[f"p{p_word(p)}_{name}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
