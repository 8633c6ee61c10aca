"""Choosing the prefill:decode ratio.

Two ways, which should agree:

* `plan`: simulate every split of the GPUs (and colocated) under the workload and SLOs and
  take the highest goodput (exact, seconds to minutes);
* `ratio_for`: read off the step-time model what each pool can take within its SLO -- a
  prefill pool as M/G/1 queues against the TTFT SLO, a decode pool as the largest batch
  whose step meets the TPOT SLO -- and take the split whose smaller pool takes the most
  (DistServe's placement reasoning; instant, so an autoscaler can run it on measured
  lengths).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvray.sim.cluster import ClusterSpec
from kvray.sim.cost_model import RequestWork, StepTimeModel
from kvray.sim.studies import GoodputRow, Workload, candidates, compare
from kvray.sim.worker import SimEngineConfig


@dataclass(frozen=True)
class Plan:
    best: ClusterSpec
    rows: list[GoodputRow]  # every candidate's goodput, in the order tried


def plan(
    work: Workload,
    cost: StepTimeModel,
    engine: SimEngineConfig,
    num_gpus: int,
    disaggregated_only: bool = False,
) -> Plan:
    """The candidate with the highest goodput (ties: the first, colocated before PD)."""
    specs = [s for s in candidates(cost, engine, num_gpus) if s.disaggregated or not disaggregated_only]
    rows = compare(specs, work)
    i = max(range(len(rows)), key=lambda k: (rows[k].goodput, -k))
    return Plan(specs[i], rows)


def prefill_seconds(cost: StepTimeModel, engine: SimEngineConfig, prompt_len: int) -> float:
    """One prompt alone on a prefill worker: its chunks of the token budget, back to back."""
    budget, done, seconds = engine.max_num_batched_tokens, 0, 0.0
    while done < prompt_len:
        n = min(budget, prompt_len - done)
        seconds += cost.predict([RequestWork(n, done + n, done + n == prompt_len)])
        done += n
    return seconds


def prefill_rate(
    cost: StepTimeModel, engine: SimEngineConfig, prompt_lens: Sequence[int], num_workers: int, ttft_s: float
) -> float:
    """Requests/s a prefill pool takes with its 90th-percentile TTFT within the SLO: each
    worker an M/G/1 queue (Poisson arrivals split evenly) whose service per prompt is its
    share of a step packed with prompts like it (as many as the token budget and
    max_num_seqs hold; a long one alone, chunk after chunk); p90 TTFT taken as the p90 step
    + the p90 wait (0 with probability 1 - rho, exponential beyond with the M/G/1 mean)."""
    budget = engine.max_num_batched_tokens
    steps, shares = [], []
    for n in prompt_lens:
        k = max(1, min(budget // n, engine.max_num_seqs))
        seconds = (
            cost.predict([RequestWork(n, n, True)] * k) if n <= budget else prefill_seconds(cost, engine, n)
        )
        steps.append(seconds)
        shares.append(seconds / k)
    mean = sum(shares) / len(shares)
    second = sum(x * x for x in shares) / len(shares)
    p90 = sorted(steps)[int(0.9 * (len(steps) - 1))]
    if p90 > ttft_s:
        return 0.0

    def ttft90(rate: float) -> float:
        lam = rate / num_workers
        rho = lam * mean
        if rho >= 1:
            return math.inf
        wait = lam * second / (2 * (1 - rho))  # Pollaczek-Khinchine mean wait
        # the wait is 0 with probability 1 - rho and about exponential beyond: its p90
        return p90 + (wait / rho * math.log(10 * rho) if rho > 0.1 else 0.0)

    lo, hi = 0.0, num_workers / mean
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ttft90(mid) <= ttft_s else (lo, mid)
    return lo


def decode_rate(
    cost: StepTimeModel,
    engine: SimEngineConfig,
    context_len: float,
    output_len: float,
    num_workers: int,
    tpot_s: float,
) -> float:
    """Requests/s a decode pool carries with its steps within the TPOT SLO: the largest
    batch B whose step t(B) meets it, each worker finishing B / (output_len x t(B))
    requests/s (Little's law), within its blocks and max_num_seqs."""
    c = max(1, int(context_len))
    limit = min(engine.max_num_seqs, max(1, engine.num_blocks * engine.block_size // c))
    best = 0.0
    for b in range(1, limit + 1):
        t = cost.predict([RequestWork(1, c, True)] * b)
        if t > tpot_s:
            break
        best = b / (max(output_len - 1, 1) * t)
    return best * num_workers


def ratio_for(
    work: Workload, cost: StepTimeModel, engine: SimEngineConfig, num_workers: int, sample: int = 1000
) -> tuple[int, int]:
    """(prefill, decode) workers out of `num_workers` (at least one each) with the highest
    analytic goodput: the smaller of what the two pools can take within their SLOs."""
    if num_workers < 2:
        raise ValueError(f"a PD split needs at least 2 workers, got {num_workers}")
    rng = random.Random(work.seed)
    lens = [work.mix.sample(rng) for _ in range(sample)]
    prompts = [p for p, _ in lens]
    mean_p = sum(prompts) / sample
    mean_o = sum(o for _, o in lens) / sample
    splits = []
    for p in range(1, num_workers):
        take = min(
            prefill_rate(cost, engine, prompts, p, work.slo.ttft_s),
            decode_rate(cost, engine, mean_p + mean_o / 2, mean_o, num_workers - p, work.slo.tpot_s),
        )
        splits.append((take, p))
    take, p = max(splits, key=lambda t: (t[0], -t[1]))  # ties: fewer prefill workers
    if take <= 0:
        raise ValueError(
            f"no P:D split of {num_workers} workers meets the SLOs {work.slo} for {work.mix.name}"
        )
    return p, num_workers - p
