"""What a simulation measured, per request and in total, in `vllm bench serve`'s terms."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def percentile(xs: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), NaN for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class RequestRecord:
    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)  # when each output token reached the client

    @property
    def done(self) -> bool:
        return len(self.token_times) >= self.output_len

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival_s

    @property
    def tpot(self) -> float:
        """Mean seconds per output token after the first (0 for one-token outputs)."""
        if len(self.token_times) < 2:
            return 0.0
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival_s

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def met(self, r: RequestRecord) -> bool:
        return r.done and r.ttft <= self.ttft_s and r.tpot <= self.tpot_s


@dataclass
class SLOBudget:
    """Lets a run stop as soon as more of the `measured` requests have missed the SLO than
    `allowed` (its verdict is known: a goodput search needs no more)."""

    slo: SLO
    measured: set[str]
    allowed: int
    missed: set[str] = field(default_factory=set)

    def on_token(self, r: RequestRecord) -> None:
        if r.request_id not in self.measured or r.request_id in self.missed:
            return
        if (len(r.token_times) == 1 and r.ttft > self.slo.ttft_s) or (r.done and r.tpot > self.slo.tpot_s):
            self.missed.add(r.request_id)

    @property
    def exhausted(self) -> bool:
        return len(self.missed) > self.allowed


@dataclass
class SimResult:
    records: list[RequestRecord]
    num_gpus: int
    busy_s: dict[str, float]  # worker id -> seconds it spent stepping
    num_preemptions: int = 0
    num_kv_recomputes: int = 0
    gave_up: bool = False  # stopped early: an SLOBudget ran out

    @property
    def duration(self) -> float:
        done = [r for r in self.records if r.token_times]
        if not done:
            return 0.0
        return max(r.token_times[-1] for r in done) - min(r.arrival_s for r in self.records)

    def attainment(self, slo: SLO, request_ids: set[str] | None = None) -> float:
        """Share of requests (of `request_ids`, default all) that finished within both SLOs
        (DistServe's SLO attainment)."""
        rs = [r for r in self.records if request_ids is None or r.request_id in request_ids]
        return sum(slo.met(r) for r in rs) / len(rs)

    def summary(self, percentiles: Sequence[float] = (50, 90, 99)) -> dict:
        """`vllm bench serve`'s result keys (milliseconds for latencies)."""
        done = [r for r in self.records if r.done]
        out_tokens = sum(r.output_len for r in done)
        d = self.duration or math.nan
        s = {
            "completed": len(done),
            "duration": d,
            "total_input_tokens": sum(r.prompt_len for r in done),
            "total_output_tokens": out_tokens,
            "request_throughput": len(done) / d,
            "output_throughput": out_tokens / d,
        }
        metrics = {
            "ttft": [r.ttft for r in done],
            "tpot": [r.tpot for r in done if r.output_len > 1],
            "itl": [x for r in done for x in r.itls],
            "e2el": [r.e2e for r in done],
        }
        for name, xs in metrics.items():
            s[f"mean_{name}_ms"] = 1000 * sum(xs) / len(xs) if xs else math.nan
            s[f"median_{name}_ms"] = 1000 * percentile(xs, 50)
            for p in percentiles:
                s[f"p{p:g}_{name}_ms"] = 1000 * percentile(xs, p)
        s["num_preemptions"] = self.num_preemptions
        s["num_kv_recomputes"] = self.num_kv_recomputes
        return s
