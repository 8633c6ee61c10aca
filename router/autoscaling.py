"""kvray's Serve autoscaling policy for a worker pool: LLM signals, not request counts.

Each pool replica reports its worker's signals (`PoolReplica.record_autoscaling_stats`);
Serve averages them per replica over `look_back_period_s` and calls the policy, which
asks for enough workers to bring every signal to its target and takes the largest ask:

* prefill: queued prompt tokens (summed: tokens / target per worker) and the time its
  prompts take to their first token (mean, scaled with the pool);
* decode / mixed: KV-cache usage and inter-token latency (means, scaled with the pool),
  requests admitted or waiting (summed: requests / target per worker), and the prompt
  tokens a worker computes itself (summed, as prefill's): a mixed worker's prompts, and a
  decode worker's short prompts (`router.max_local_prefill_length`), moved requests and
  failed pulls. A decode worker's pulled prompts never count: they wait outside its queue.
* embedding: the tokens of the inputs waiting for a batch (summed, as prefill's).

Requests that wait at an ingress for a worker of the pool to join (the pool is empty while
Serve replaces a dead worker, see `Frontend._route`) count too: each ingress replica
publishes them per role in Ray's internal KV (`publish_waiting`), and the policy adds the
fresh ones to the summed signals (`read_waiting`) -- their prompt tokens to the prefill
pool's queue, the requests to the decode or mixed pool's.

Serve then applies min/max replicas and the upscale/downscale delays. Ray Serve's own
policy reads ongoing requests at the replica, which a pool replica never sees (requests
go from the Router straight to the worker), hence a custom policy.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

from kvray.configs import PoolAutoscaling, PoolConfig

POLICY = "kvray.router.autoscaling:PoolPolicy"
SUMMED = {
    "queued_prompt_tokens": "target_queued_prompt_tokens",
    "running_requests": "target_running_requests",
}
MEANS = {
    "ttft_seconds": "target_ttft_seconds",
    "kv_cache_usage": "target_kv_cache_usage",
    "itl_seconds": "target_itl_seconds",
}
SIGNALS = {
    "prefill": ("queued_prompt_tokens", "ttft_seconds"),
    "decode": ("queued_prompt_tokens", "kv_cache_usage", "running_requests", "itl_seconds"),
}
SIGNALS["mixed"] = ("ttft_seconds", *SIGNALS["decode"])
SIGNALS["embedding"] = ("queued_prompt_tokens",)  # the inputs' tokens waiting for a batch
WAITING_FRESH_S = 10.0  # an ingress's waiting counts older than this are stale (it is gone)
WAITING_READ_S = 1.0  # the policy reads them at most this often (Serve calls it every 0.1 s)


def _waiting_key(app_name: str, front_id: str = "") -> bytes:
    return f"kvray/{app_name}/front-waiting/{front_id}".encode()


def publish_waiting(app_name: str, front_id: str, waiting: dict[str, dict[str, float]]) -> None:
    """Record an ingress's waiting requests (role -> summed signal -> value), stamped now."""
    from ray.experimental import internal_kv

    body = json.dumps({"time": time.time(), "waiting": waiting}).encode()
    internal_kv._internal_kv_put(_waiting_key(app_name, front_id), body, True)


def read_waiting(app_name: str, role: str) -> dict[str, float]:
    """The fresh waiting signals of `role`, summed over the ingress replicas."""
    from ray.experimental import internal_kv

    total: dict[str, float] = {}
    now = time.time()
    for key in internal_kv._internal_kv_list(_waiting_key(app_name)):
        raw = internal_kv._internal_kv_get(key)
        entry = json.loads(raw) if raw else None
        if not entry or now - entry["time"] > WAITING_FRESH_S:
            continue
        for signal, value in entry["waiting"].get(role, {}).items():
            total[signal] = total.get(signal, 0.0) + value
    return total


def desired_workers(role: str, targets: dict, current: int, metrics: dict[str, list[float]]) -> int | None:
    """The pool size every signal asks for, at most (`metrics`: signal -> one value per
    running replica). None where no signal with a target has a value yet (no opinion)."""
    asks = []
    for signal in SIGNALS[role]:
        values = metrics.get(signal)
        if not values:
            continue
        if signal in SUMMED:
            target = targets.get(SUMMED[signal])
            if target:
                asks.append(math.ceil(sum(values) / target))
        else:
            target = targets.get(MEANS[signal])
            if target:
                asks.append(math.ceil(current * (sum(values) / len(values)) / target))
    return max(asks) if asks else None


class PoolPolicy:
    """Serve instantiates this once per deployment with `policy_kwargs` (in its controller,
    where Ray's internal KV is at hand). `waiting`: reads the requests waiting at the
    ingresses for this pool (default: `read_waiting` of the app; a test passes its own)."""

    def __init__(
        self,
        role: str,
        targets: dict,
        app_name: str = "",
        waiting: Callable[[], dict] | None = None,
        planner: dict | None = None,
        engine: dict | None = None,
        totals: Callable[[], tuple[float, float, float]] | None = None,
    ):
        """`planner` (a PlannerConfig's fields) adds kvray.sim's sizing from the app's
        measured rates (`totals`: cumulative finished requests, prompt and output tokens;
        default: the ingresses' published request metrics)."""
        self.role = role
        self.targets = targets
        self.waiting = waiting or (lambda: read_waiting(app_name, role) if app_name else {})
        self.last_waiting: dict[str, float] = {}
        self.read_at = float("-inf")
        self.sizing = None
        if planner is not None:
            from kvray.router.planner_sizing import PlannerSizing, request_totals

            self.sizing = PlannerSizing(
                role, planner, engine or {}, totals or (lambda: request_totals(app_name))
            )

    def __call__(self, ctx) -> tuple[int, dict]:
        aggregated = ctx.aggregated_metrics or {}
        metrics = {name: list(per_replica.values()) for name, per_replica in aggregated.items()}
        for signal, value in self._waiting().items():
            if signal in SUMMED and value:  # one more addend of the sum
                metrics.setdefault(signal, []).append(value)
        want = desired_workers(self.role, self.targets, ctx.current_num_replicas, metrics)
        planned = self.sizing.ask() if self.sizing is not None else None
        if planned is not None:
            want = planned if want is None else max(want, planned)
        if want is None:  # no signal has an opinion yet: keep the size
            want = ctx.current_num_replicas
        return max(want, 1), ctx.policy_state

    def _waiting(self) -> dict[str, float]:
        if time.monotonic() - self.read_at >= WAITING_READ_S:
            self.read_at = time.monotonic()
            try:
                self.last_waiting = self.waiting()
            except Exception:  # the KV is unreachable for a moment: decide on the workers' signals
                self.last_waiting = {}
        return self.last_waiting


def autoscaling_config(role: str, pool: PoolConfig, app_name: str = "", engine: dict | None = None) -> dict:
    """Serve's autoscaling_config for the pool (bounds, delays, kvray's policy; `engine`:
    the pool's engine arguments, for a planner block)."""
    a: PoolAutoscaling = pool.autoscaling
    targets = a.model_dump(include=set(SUMMED.values()) | set(MEANS.values()))
    kwargs = {"role": role, "targets": targets, "app_name": app_name}
    if a.planner is not None:
        kwargs |= {"planner": a.planner.model_dump(), "engine": dict(engine or {})}
    return {
        "min_replicas": a.min_workers,
        "max_replicas": a.max_workers,
        "initial_replicas": min(max(pool.num_workers, a.min_workers), a.max_workers),
        "upscale_delay_s": a.upscale_delay_s,
        "downscale_delay_s": a.downscale_delay_s,
        "look_back_period_s": a.look_back_period_s,
        "policy": {
            "policy_function": POLICY,
            "policy_kwargs": kwargs,
        },
    }
