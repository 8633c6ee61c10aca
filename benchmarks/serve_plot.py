"""`kvray bench serve --plot DIR`: PNGs of a run's latency CDFs and of a rate sweep.

Per run, `{stem}-cdf.png`: the empirical CDFs of TTFT, ITL and E2EL over the run's
successful requests. Per sweep, `sweep.png`: request and output-token throughput, and
p99 TTFT / ITL / E2EL, against the configured request rate (one tick per rate in the
order given, so `inf` fits: the x axis is categorical). matplotlib is optional (`pip install matplotlib`,
or the `bench` extra) and imported only here, with the Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvray.errors import KvrayError

LATENCIES = (("ttfts", "TTFT"), ("itls", "ITL"), ("e2els", "E2EL"))


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise KvrayError("--plot needs matplotlib: pip install matplotlib (or kvray[bench])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_samples_ms(result: dict) -> dict[str, np.ndarray]:
    """Milliseconds per latency over successful requests (ITL: every gap of every request)."""
    ok = [not e for e in result["errors"]]
    out = {}
    for key, label in LATENCIES:
        values = [v for v, good in zip(result[key], ok) if good]
        if key == "itls":
            values = [gap for gaps in values for gap in gaps]
        out[label] = np.asarray(values, dtype=float) * 1000
    return out


def _stem(result: dict) -> str:
    conc = result["max_concurrency"]
    return f"{result['request_rate']}qps" + (f"-concurrency{conc}" if conc is not None else "")


def plot_run(result: dict, out_dir: Path) -> Path:
    plt = require_matplotlib()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (label, ms) in zip(axes, latency_samples_ms(result).items()):
        xs = np.sort(ms)
        ax.step(xs, np.arange(1, len(xs) + 1) / max(len(xs), 1), where="post")
        ax.set(title=f"{label} CDF ({len(xs)} samples)", xlabel=f"{label} (ms)", ylabel="fraction <= x")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['model_id']} at {result['request_rate']} req/s, {result['completed']} completed")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{_stem(result)}-cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(results: list[dict], out_dir: Path) -> Path:
    plt = require_matplotlib()
    ticks = np.arange(len(results))
    labels = [str(r["request_rate"]) for r in results]
    fig, (thr, lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    thr.plot(ticks, [r["request_throughput"] for r in results], "o-", label="requests/s")
    tok = thr.twinx()
    tok.plot(ticks, [r["output_throughput"] for r in results], "s--", color="C1", label="output tok/s")
    thr.set(title="throughput", xlabel="request rate (req/s)", ylabel="completed requests/s")
    tok.set_ylabel("output tokens/s")
    thr.legend(loc="upper left")
    tok.legend(loc="lower right")
    for label in ("TTFT", "ITL", "E2EL"):
        samples = [latency_samples_ms(r)[label] for r in results]
        p99 = [np.percentile(ms, 99) if len(ms) else np.nan for ms in samples]
        lat.plot(ticks, p99, "o-", label=f"p99 {label}")
    lat.set(title="p99 latency", xlabel="request rate (req/s)", ylabel="ms", yscale="log")
    lat.legend()
    for ax in (thr, lat):
        ax.set_xticks(ticks, labels)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
