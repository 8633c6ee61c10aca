"""Prometheus metrics, vLLM's names with the prefix `kvray:`.

Request-level numbers (latencies, queue time, token counts, outcomes, cost) are recorded by
the front that owns each request (an ingress replica), where its tokens arrive. Each front
keeps them as plain cumulative numbers (`RequestStats`) and publishes a snapshot after
each change (router/app.py: Ray's cluster KV, within 0.2 s), so `/metrics` of any replica merges every
front's numbers (counters and histogram buckets add up). Worker-level numbers (queue
lengths, KV usage, prefix cache, transfers, preemptions) are read from every live worker's
`stats()` when `/metrics` is rendered and labelled by `role` and `worker`; each worker
keeps its own cumulative KV-pull histogram, so who reads it does not matter.
"""

from __future__ import annotations

import bisect
import json
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvray.actors.messages import TRANSFER_BUCKETS, WorkerStats
from kvray.tracing import TIME_IN_QUEUE, RequestTrace

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
COST_BUCKETS = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)

# name -> (help, buckets)
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time to first token.", LATENCY_BUCKETS),
    "inter_token_latency_seconds": ("Time between output tokens.", LATENCY_BUCKETS),
    "e2e_request_latency_seconds": ("Arrival to final output.", LATENCY_BUCKETS),
    "request_queue_time_seconds": (
        "Time in the engine's queue before first scheduled (the prefill worker's, when handed off).",
        LATENCY_BUCKETS,
    ),
    "request_prompt_tokens": ("Prompt tokens per request.", TOKEN_BUCKETS),
    "request_generation_tokens": ("Generated tokens per request.", TOKEN_BUCKETS),
    "request_cost_usd": (
        "Worker price x the request's share of the worker's engine steps, over its workers.",
        COST_BUCKETS,
    ),
}
COUNTERS = {
    "prompt_tokens": "Prefilled prompt tokens.",
    "generation_tokens": "Generated tokens.",
    "request_migrations": "Requests moved to another worker after theirs died mid-stream.",
    "local_prefills": "Requests sent whole to a decode worker (router.max_local_prefill_length).",
}


def _empty() -> dict:
    return {
        "hist": {name: {"counts": [0] * (len(b) + 1), "sum": 0.0} for name, (_, b) in HISTOGRAMS.items()},
        "count": {name: 0 for name in COUNTERS},
        "success": {},  # finish reason -> requests
    }


class RequestStats:
    """One front's request metrics, as cumulative plain numbers (a JSON-able snapshot)."""

    def __init__(self):
        self.data = _empty()
        self.version = 0  # bumped by every finished request: a publisher sends only news

    def observe(self, name: str, value: float, times: int = 1) -> None:
        h = self.data["hist"][name]
        h["counts"][bisect.bisect_left(HISTOGRAMS[name][1], value)] += times
        h["sum"] += value * times

    def count(self, name: str, n: int = 1) -> None:
        self.data["count"][name] += n
        self.version += 1

    def finish(self, timer: RequestTimer, finish_reason: str) -> None:
        self.observe("e2e_request_latency_seconds", time.monotonic() - timer.arrival)
        self.observe("request_prompt_tokens", timer.num_prompt_tokens)
        self.observe("request_generation_tokens", timer.num_tokens)
        self.observe("request_cost_usd", timer.cost_usd)
        self.data["count"]["prompt_tokens"] += timer.num_prompt_tokens
        self.data["count"]["generation_tokens"] += timer.num_tokens
        success = self.data["success"]
        success[finish_reason] = success.get(finish_reason, 0) + 1
        self.version += 1

    def snapshot(self) -> dict:
        return self.data


def front_key(app_name: str, front_id: str = "") -> bytes:
    """Where an ingress replica publishes its request metrics in Ray's cluster KV."""
    return f"kvray/{app_name}/front-metrics/{front_id}".encode()


def published(app_name: str, skip: str = "") -> list[dict]:
    """Every ingress replica's last published request metrics but `skip`'s (also those of
    replicas that are gone: their counts stay in the app's totals)."""
    from ray.experimental import internal_kv

    keys = [
        k
        for k in internal_kv._internal_kv_list(front_key(app_name))
        if not skip or k != front_key(app_name, skip)
    ]
    values = [internal_kv._internal_kv_get(k) for k in keys]
    return [json.loads(v) for v in values if v]


def merge(snapshots: list[dict]) -> dict:
    total = _empty()
    for s in snapshots:
        for name, h in s["hist"].items():
            t = total["hist"][name]
            t["counts"] = [a + b for a, b in zip(t["counts"], h["counts"])]
            t["sum"] += h["sum"]
        for name, n in s["count"].items():
            total["count"][name] = total["count"].get(name, 0) + n
        for reason, n in s["success"].items():
            total["success"][reason] = total["success"].get(reason, 0) + n
    return total


@dataclass
class RequestTimer:
    """One request's clock, kept by its front from arrival to its final output."""

    stats: RequestStats
    num_prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    cost_usd: float = 0.0
    queue_seen: bool = False
    trace: RequestTrace | None = None  # the request's trace (its root span gets the queue time)

    def on_queue_time(self, seconds: float | None) -> None:
        """The queue time of the engine that ran the prompt (observed once)."""
        if seconds is not None and not self.queue_seen:
            self.queue_seen = True
            self.stats.observe("request_queue_time_seconds", seconds)
            if self.trace is not None:
                self.trace.set({TIME_IN_QUEUE: seconds})

    def on_tokens(self, new: int) -> None:
        if new <= 0:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
            self.stats.observe("time_to_first_token_seconds", now - self.arrival)
            if new > 1:
                self.stats.observe("inter_token_latency_seconds", 0.0, new - 1)
        else:
            self.stats.observe("inter_token_latency_seconds", (now - self.last_token) / new, new)
        self.last_token = now
        self.num_tokens += new


def render(model_name: str, requests: dict, workers: list[WorkerStats]) -> bytes:
    """The Prometheus text format of merged request numbers and the workers' stats."""
    registry = CollectorRegistry()
    registry.register(_Collector(model_name, requests, workers))
    return generate_latest(registry)


def _buckets(bounds: tuple, counts: list[int]) -> list[tuple[str, int]]:
    out, running = [], 0
    for bound, n in zip([*map(float, bounds), float("inf")], counts):
        running += n
        out.append(("+Inf" if bound == float("inf") else repr(bound), running))
    return out


class _Collector:
    def __init__(self, model_name: str, requests: dict, workers: list[WorkerStats]):
        self.model_name = model_name
        self.requests = requests
        self.workers = workers

    def collect(self):
        m = self.model_name
        for name, (doc, bounds) in HISTOGRAMS.items():
            h = self.requests["hist"][name]
            family = HistogramMetricFamily(f"kvray:{name}", doc, labels=["model_name"])
            family.add_metric([m], _buckets(bounds, h["counts"]), h["sum"])
            yield family
        for name, doc in COUNTERS.items():
            family = CounterMetricFamily(f"kvray:{name}", doc, labels=["model_name"])
            family.add_metric([m], self.requests["count"][name])
            yield family
        family = CounterMetricFamily(
            "kvray:request_success",
            "Finished requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason, n in sorted(self.requests["success"].items()):
            family.add_metric([m, reason], n)
        yield family
        yield from self._workers()

    def _workers(self):
        labels = ["model_name", "role", "worker"]
        gauges = {
            "num_requests_running": ("Requests in the worker's running batch.", "num_running"),
            "num_requests_waiting": ("Requests waiting for the worker's batch.", "num_waiting"),
            "kv_cache_usage_perc": ("Used KV blocks / total (0..1).", "kv_usage"),
            "kv_cache_used_blocks": ("KV blocks held by requests or pins.", "used_blocks"),
            "kv_pinned_requests": ("Prefilled prompts pinned for a decode worker's pull.", "pinned"),
        }
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", "prefix_queries"),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", "prefix_hits"),
            "num_preemptions": ("Requests preempted (recomputed later).", "num_preemptions"),
            "kv_transfer_bytes": ("KV bytes pulled in plus sent out.", "kv_transfer_bytes"),
            "kv_recompute": ("Prompts recomputed, not pulled (failed, or no room in time).", "kv_recomputes"),
        }
        for kind, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, (doc, attr) in table.items():
                family = kind(f"kvray:{name}", doc, labels=labels)
                for s in self.workers:
                    family.add_metric([self.model_name, s.role, s.worker_id], getattr(s, attr))
                yield family
        family = HistogramMetricFamily(
            "kvray:kv_transfer_seconds", "Duration of one KV pull (decode side).", labels=labels
        )
        for s in self.workers:
            counts = s.kv_pull_buckets or [0] * (len(TRANSFER_BUCKETS) + 1)
            family.add_metric(
                [self.model_name, s.role, s.worker_id],
                _buckets(TRANSFER_BUCKETS, counts),
                s.kv_transfer_seconds,
            )
        yield family
        yield from self._spec_decode(labels)

    def _spec_decode(self, labels: list[str]):
        """vLLM's spec_decode counters, per worker (zero where speculation is off)."""
        counters = {
            "spec_decode_num_drafts": ("Drafts verified (requests x steps with proposals).", "num_drafts"),
            "spec_decode_num_draft_tokens": ("Tokens proposed.", "num_draft_tokens"),
            "spec_decode_num_accepted_tokens": ("Proposed tokens accepted.", "num_accepted_tokens"),
        }
        for name, (doc, attr) in counters.items():
            family = CounterMetricFamily(f"kvray:{name}", doc, labels=labels)
            for s in self.workers:
                family.add_metric([self.model_name, s.role, s.worker_id], getattr(s.spec_decode, attr))
            yield family
        family = CounterMetricFamily(
            "kvray:spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by position in the draft (0 first).",
            labels=[*labels, "position"],
        )
        for s in self.workers:
            for pos, n in enumerate(s.spec_decode.accepted_per_pos):
                family.add_metric([self.model_name, s.role, s.worker_id, str(pos)], n)
        yield family
