"""What the simulator is for: goodput of PD against colocated serving on the same GPUs.

Goodput (DistServe's): the highest request rate at which at least 90 % of requests meet
both the TTFT and the TPOT SLO, found by bisection on the rate (the same arrivals,
scaled, at every rate); per GPU, it divides by the GPUs the cluster uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvray.sim.cluster import ClusterSpec, PoolSpec, simulate
from kvray.sim.cost_model import StepTimeModel
from kvray.sim.results import SLO, SLOBudget
from kvray.sim.worker import SimEngineConfig
from kvray.sim.workload import MIXES, LengthMix, SimRequest, synthetic


@dataclass(frozen=True)
class Workload:
    """A length mix under SLOs. A run at rate r sends max(min_requests, r x duration_s)
    requests and judges the middle half by arrival (the first quarter meets a cluster
    still filling up, the last a cluster draining: both flatter it)."""

    mix: LengthMix
    slo: SLO
    duration_s: float = 20.0
    min_requests: int = 80
    burstiness: float = 1.0
    seed: int = 0

    def requests(self, rate: float) -> list[SimRequest]:
        n = max(self.min_requests, math.ceil(rate * self.duration_s))
        return synthetic(self.mix, n, rate, self.burstiness, self.seed)


# DistServe's workloads with SLOs scaled to Llama-3.1-8B on one H100 (its OPT models were
# 13-175B on A100s): chat wants a quick first token and smooth streaming; summaries of long
# documents wait longer for the first token but stream as smoothly.
WORKLOADS: dict[str, Workload] = {
    "chatbot": Workload(MIXES["chatbot"], SLO(0.25, 0.025)),
    "summarization": Workload(MIXES["summarization"], SLO(1.5, 0.025)),
}


def attainment_at(spec: ClusterSpec, work: Workload, rate: float, target: float | None = None) -> float:
    """SLO attainment of the judged requests at `rate`; with `target`, the run stops as
    soon as it cannot reach it (the value is then below target, not exact)."""
    reqs = work.requests(rate)
    judged = {r.request_id for r in reqs[len(reqs) // 4 : len(reqs) - len(reqs) // 4]}
    budget = None
    if target is not None:
        # misses allowed: attainment >= target exactly when misses <= n - ceil(target n)
        budget = SLOBudget(work.slo, judged, len(judged) - math.ceil(target * len(judged) - 1e-9))
    return simulate(spec, reqs, budget).attainment(work.slo, judged)


def goodput(
    spec: ClusterSpec, work: Workload, target: float = 0.9, iters: int = 6, guess: float = 1.0
) -> float:
    """Requests/s (whole cluster) at which `target` of requests meet the SLOs, to within a
    factor 2^(1/2^iters) (about 1 % at 6); 0 if even guess / 128 misses them."""

    def ok(rate: float) -> bool:
        return attainment_at(spec, work, rate, target) >= target

    lo, hi = guess, guess
    if ok(guess):
        while ok(hi * 2):  # bracket: double until it fails
            hi *= 2
            if hi > 1e5:
                return math.inf
        lo, hi = hi, hi * 2
    else:
        while not ok(lo / 2):
            lo /= 2
            if lo < guess / 64:
                return 0.0
        lo, hi = lo / 2, lo
    for _ in range(iters):  # geometric bisection
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def pd_cluster(
    cost: StepTimeModel, engine: SimEngineConfig, num_prefill: int, num_decode: int, **kw
) -> ClusterSpec:
    return ClusterSpec(
        prefill=PoolSpec(num_prefill, engine, cost), decode=PoolSpec(num_decode, engine, cost), **kw
    )


def colocated_cluster(cost: StepTimeModel, engine: SimEngineConfig, num_workers: int, **kw) -> ClusterSpec:
    return ClusterSpec(mixed=PoolSpec(num_workers, engine, cost), **kw)


def candidates(cost: StepTimeModel, engine: SimEngineConfig, num_gpus: int) -> list[ClusterSpec]:
    """Colocated on all the GPUs, and every P:D split of them (TP groups of cost.tp)."""
    groups = num_gpus // cost.tp
    out = [colocated_cluster(cost, engine, groups)]
    out += [pd_cluster(cost, engine, p, groups - p) for p in range(1, groups)]
    return out


@dataclass(frozen=True)
class GoodputRow:
    name: str
    num_gpus: int
    goodput: float  # requests/s of the whole cluster

    @property
    def per_gpu(self) -> float:
        return self.goodput / self.num_gpus


def compare(specs: Sequence[ClusterSpec], work: Workload) -> list[GoodputRow]:
    return [GoodputRow(s.name, s.num_gpus, goodput(s, work)) for s in specs]


def slo_sweep(
    specs: Sequence[ClusterSpec], work: Workload, scales: Sequence[float]
) -> dict[float, list[GoodputRow]]:
    """Goodput as both SLOs are scaled (below 1: tighter)."""
    out = {}
    for k in scales:
        w = replace(work, slo=SLO(work.slo.ttft_s * k, work.slo.tpot_s * k))
        out[k] = compare(specs, w)
    return out


def rate_curve(spec: ClusterSpec, work: Workload, rates: Sequence[float]) -> list[tuple[float, float]]:
    """(rate, SLO attainment) points, for the plots."""
    return [(r, attainment_at(spec, work, r)) for r in rates]


def best(rows: Sequence[GoodputRow], key: Callable[[GoodputRow], float] = lambda r: r.per_gpu) -> GoodputRow:
    return max(rows, key=key)
