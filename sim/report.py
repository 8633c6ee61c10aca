"""`kvray sim study`: the tables (markdown) and plots of the PD-against-colocated studies."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from kvray.errors import KvrayError
from kvray.sim.cost_model import StepTimeModel
from kvray.sim.planner import ratio_for
from kvray.sim.results import SLO
from kvray.sim.studies import WORKLOADS, Workload, attainment_at, candidates, colocated_cluster, goodput
from kvray.sim.worker import SimEngineConfig

SLO_SCALES = (0.5, 1.0, 2.0)
BUDGETS = (512, 2048, 16384)  # 16384: larger than any prompt, so no prompt is chunked
ITERS = 4  # bisection steps of each goodput: to within 2^(1/16), about 4 %


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and b != float("inf") else "-"


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def run_study(
    cost: StepTimeModel,
    engine: SimEngineConfig,
    num_gpus: int,
    workload_names: str,
    duration_s: float,
    plot_dir: Path | None,
    save: Path | None,
) -> dict:
    if plot_dir is not None:
        _pyplot()  # before minutes of simulation, not after them
    start = time.monotonic()
    print(f"{cost.model.name} on {num_gpus} x {cost.hardware.name} (TP {cost.tp}), step model: {cost.source}")
    print(f"engine: {engine}\n")
    out: dict = {"model": cost.model.name, "gpu": cost.hardware.name, "num_gpus": num_gpus, "workloads": {}}
    for name in workload_names.split(","):
        work = replace(WORKLOADS[name], duration_s=duration_s)
        found = _one_workload(name, work, cost, engine, num_gpus)
        out["workloads"][name] = found
        if plot_dir is not None:
            _plot(plot_dir, name, work, found, cost, engine, num_gpus)
    print(f"({time.monotonic() - start:.0f} s)")
    if save is not None:
        save.write_text(json.dumps(out, indent=1))
    return out


def _one_workload(name: str, work: Workload, cost, engine, num_gpus: int) -> dict:
    m = work.mix
    print(
        f"## {name}: prompts ~{m.prompt_mean:.0f} tokens, outputs ~{m.output_mean:.0f}; "
        f"SLO TTFT {work.slo.ttft_s * 1e3:.0f} ms, TPOT {work.slo.tpot_s * 1e3:.0f} ms (90 % of requests)\n"
    )
    specs = candidates(cost, engine, num_gpus)
    if len(specs) < 2:
        raise ValueError(f"--num-gpus {num_gpus} with TP {cost.tp}: a PD split needs 2 TP groups or more")
    num_gpus = specs[0].num_gpus  # what the groups use (a remainder of num_gpus % tp idles)
    colocated = goodput(specs[0], work, iters=ITERS, guess=4.0 * num_gpus)
    rows = [(specs[0], colocated)] + [(s, goodput(s, work, iters=ITERS, guess=colocated)) for s in specs[1:]]
    p, d = ratio_for(work, cost, engine, num_gpus // cost.tp)
    print(
        _table(
            ["cluster", "goodput req/s", "per GPU", "vs colocated"],
            [[s.name, f"{g:.2f}", f"{g / s.num_gpus:.2f}", _ratio(g, colocated)] for s, g in rows],
        )
    )
    best_pd = max(rows[1:], key=lambda r: r[1])[0]
    print(f"\nanalytic planner: PD {p}:{d}; simulated best PD split: {best_pd.name}\n")

    best_rate = dict(rows)[best_pd]
    sweep = []
    for k in SLO_SCALES:
        w = replace(work, slo=SLO(work.slo.ttft_s * k, work.slo.tpot_s * k))
        c = goodput(specs[0], w, iters=ITERS, guess=colocated * k) if k != 1.0 else colocated
        q = goodput(best_pd, w, iters=ITERS, guess=best_rate * k) if k != 1.0 else best_rate
        sweep.append([k, c / num_gpus, q / num_gpus])
    print(
        _table(
            ["SLO scale", "colocated per GPU", f"{best_pd.name} per GPU", "PD / colocated"],
            [[k, f"{c:.2f}", f"{q:.2f}", _ratio(q, c)] for k, c, q in sweep],
        )
    )

    chunks = []
    for budget in BUDGETS:
        spec = colocated_cluster(cost, replace(engine, max_num_batched_tokens=budget), num_gpus // cost.tp)
        rate = (
            colocated
            if budget == engine.max_num_batched_tokens
            else goodput(spec, work, iters=ITERS, guess=colocated)
        )
        chunks.append([budget, rate / num_gpus])
    print()
    print(
        _table(
            ["colocated, max_num_batched_tokens", "goodput per GPU"],
            [[f"{b}" + (" (no chunking)" if b == BUDGETS[-1] else ""), f"{g:.2f}"] for b, g in chunks],
        )
    )
    print()
    return {
        "goodput": {s.name: g for s, g in rows},
        "analytic_ratio": [p, d],
        "best_pd": best_pd.name,
        "slo_sweep": sweep,
        "chunked_prefill": chunks,
    }


def _pyplot():
    """matplotlib's pyplot (headless), or a KvrayError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise KvrayError("--plot needs matplotlib: pip install matplotlib (or kvray[bench])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot(plot_dir: Path, name: str, work: Workload, found: dict, cost, engine, num_gpus: int) -> None:
    plt = _pyplot()
    plot_dir.mkdir(parents=True, exist_ok=True)
    specs = candidates(cost, engine, num_gpus)
    top = max(found["goodput"].values())
    rates = [top * f for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for spec in specs:
        ax[0].plot(
            [r / num_gpus for r in rates],
            [attainment_at(spec, work, r) for r in rates],
            "o-",
            label=spec.name,
        )
    ax[0].axhline(0.9, color="grey", ls=":")
    ax[0].set(
        xlabel="request rate per GPU (req/s)", ylabel="SLO attainment", title=f"{name}: attainment vs rate"
    )
    ax[0].legend()
    ks = [row[0] for row in found["slo_sweep"]]
    ax[1].plot(ks, [row[1] for row in found["slo_sweep"]], "o-", label="colocated")
    ax[1].plot(ks, [row[2] for row in found["slo_sweep"]], "o-", label=found["best_pd"])
    ax[1].set(
        xlabel="SLO scale (both TTFT and TPOT)", ylabel="goodput per GPU (req/s)", title=f"{name}: SLO sweep"
    )
    ax[1].set_xscale("log")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(plot_dir / f"sim_{name}.png", dpi=90)
    plt.close(fig)
