"""Prometheus metrics, vLLM's names with the prefix `kvray:`.

Request-level numbers (latencies, queue time, token counts, outcomes, cost) are recorded by
the Router, the one place every ingress replica sends through, so `/metrics` of any replica
shows the whole app. Worker-level numbers (queue lengths, KV usage, prefix cache, transfers,
preemptions) are read from every live worker's `stats()` when `/metrics` is rendered and
labelled by `role` and `worker`; the KV pulls a worker finished since its previous
`stats()` call (whoever made it: a scrape or the router's health check) are observed one by
one into the `kv_transfer_seconds` histogram.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from kvray.actors.worker import WorkerStats
    from kvray.engine import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
COST_BUCKETS = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class RequestTimer:
    """One request's clock, kept by the Router from arrival to its final output."""

    num_prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    num_outputs: int = 0
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    cost_usd: float = 0.0


class RouterMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(f"kvray:{name}", doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.", LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to final output.", LATENCY_BUCKETS)
        self.queue = hist(
            "request_queue_time_seconds",
            "Time in the engine's queue before first scheduled (the prefill worker's, disaggregated).",
            LATENCY_BUCKETS,
        )
        self.prompt_hist = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.gen_hist = hist("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self.cost = hist(
            "request_cost_usd",
            "Worker price x time the request held the worker (shared time split by load).",
            COST_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "kvray:prompt_tokens", "Prefilled prompt tokens.", labels, registry=self.registry
        )
        self.generation_tokens = Counter(
            "kvray:generation_tokens", "Generated tokens.", labels, registry=self.registry
        )
        self.success = Counter(
            "kvray:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.kv_transfer = Histogram(
            "kvray:kv_transfer_seconds",
            "Duration of one KV pull (decode side).",
            ["model_name", "role", "worker"],
            buckets=TRANSFER_BUCKETS,
            registry=self.registry,
        )
        self.workers = _WorkerCollector(model_name)
        self.registry.register(self.workers)

    def on_output(self, timer: RequestTimer, out: RequestOutput) -> None:
        """A cumulative output arrived. The request's first output comes from the engine
        that ran its prompt (when disaggregated, the router's first-token output carries
        the prefill worker's metrics): its queue time is the request's."""
        now = time.monotonic()
        timer.num_outputs += 1
        queue_time = out.metrics.time_in_queue if out.metrics is not None else None
        if timer.num_outputs == 1 and queue_time is not None:
            self.queue.labels(self.model_name).observe(queue_time)
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        new = num_tokens - timer.num_tokens
        if new <= 0:
            return
        if timer.first_token is None:
            timer.first_token = now
            self.ttft.labels(self.model_name).observe(now - timer.arrival)
            new -= 1
        elif new > 0:
            gap = (now - timer.last_token) / new
            for _ in range(new):
                self.itl.labels(self.model_name).observe(gap)
        timer.last_token = now
        timer.num_tokens = num_tokens

    def on_finish(self, timer: RequestTimer, finish_reason: str) -> None:
        m = self.model_name
        self.e2e.labels(m).observe(time.monotonic() - timer.arrival)
        self.prompt_hist.labels(m).observe(timer.num_prompt_tokens)
        self.gen_hist.labels(m).observe(timer.num_tokens)
        self.prompt_tokens.labels(m).inc(timer.num_prompt_tokens)
        self.generation_tokens.labels(m).inc(timer.num_tokens)
        self.success.labels(m, finish_reason).inc()
        self.cost.labels(m).observe(timer.cost_usd)

    def on_worker_stats(self, stats: WorkerStats) -> None:
        """Observe the KV pulls a worker finished since its previous stats() call. Every
        stats() result must pass through here: the call drains them on the worker."""
        for seconds in stats.kv_pull_durations:
            self.kv_transfer.labels(self.model_name, stats.role, stats.worker_id).observe(seconds)

    def render(self, worker_stats: list[WorkerStats]) -> bytes:
        """The Prometheus text format, with the workers' latest stats (already passed
        through `on_worker_stats`)."""
        self.workers.stats = worker_stats
        return generate_latest(self.registry)


class _WorkerCollector:
    """Turns WorkerStats snapshots into per-worker gauges and counters at scrape time."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: list[WorkerStats] = []

    def collect(self):
        labels = ["model_name", "role", "worker"]
        gauges = {
            "num_requests_running": ("Requests in the worker's running batch.", "num_running"),
            "num_requests_waiting": ("Requests waiting for the worker's batch.", "num_waiting"),
            "kv_cache_usage_perc": ("Used KV blocks / total (0..1).", "kv_usage"),
        }
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", "prefix_queries"),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", "prefix_hits"),
            "num_preemptions": ("Requests preempted (recomputed later).", "num_preemptions"),
            "kv_transfer_bytes": ("KV bytes pulled in plus sent out.", "kv_transfer_bytes"),
            "kv_recompute": ("Prompts recomputed because a KV pull failed or came late.", "kv_recomputes"),
        }
        for name, (doc, attr) in gauges.items():
            family = GaugeMetricFamily(f"kvray:{name}", doc, labels=labels)
            for s in self.stats:
                family.add_metric([self.model_name, s.role, s.worker_id], getattr(s, attr))
            yield family
        for name, (doc, attr) in counters.items():
            family = CounterMetricFamily(f"kvray:{name}", doc, labels=labels)
            for s in self.stats:
                family.add_metric([self.model_name, s.role, s.worker_id], getattr(s, attr))
            yield family
