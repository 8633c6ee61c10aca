"""kvray's Serve autoscaling policy for a worker pool: LLM signals, not request counts.

Each pool replica reports its worker's signals (`PoolReplica.record_autoscaling_stats`);
Serve averages them per replica over `look_back_period_s` and calls the policy, which
asks for enough workers to bring every signal to its target and takes the largest ask:

* prefill: queued prompt tokens (summed: tokens / target per worker) and the time its
  prompts take to their first token (mean, scaled with the pool);
* decode / mixed: KV-cache usage and inter-token latency (means, scaled with the pool)
  and requests admitted or waiting (summed: requests / target per worker).

Serve then applies min/max replicas and the upscale/downscale delays. Ray Serve's own
policy reads ongoing requests at the replica, which a pool replica never sees (requests
go from the Router straight to the worker), hence a custom policy.
"""

from __future__ import annotations

import math

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
    "decode": ("kv_cache_usage", "running_requests", "itl_seconds"),
}
SIGNALS["mixed"] = SIGNALS["prefill"] + SIGNALS["decode"]


def desired_workers(role: str, targets: dict, current: int, metrics: dict[str, list[float]]) -> int:
    """The pool size every signal asks for, at most (`metrics`: signal -> one value per
    running replica). No signals yet: keep the current size."""
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
    return max(asks) if asks else current


class PoolPolicy:
    """Serve instantiates this once per deployment with `policy_kwargs`."""

    def __init__(self, role: str, targets: dict):
        self.role = role
        self.targets = targets

    def __call__(self, ctx) -> tuple[int, dict]:
        aggregated = ctx.aggregated_metrics or {}
        metrics = {name: list(per_replica.values()) for name, per_replica in aggregated.items()}
        want = desired_workers(self.role, self.targets, ctx.current_num_replicas, metrics)
        return max(want, 1), ctx.policy_state


def autoscaling_config(role: str, pool: PoolConfig) -> dict:
    """Serve's autoscaling_config for the pool (bounds, delays, kvray's policy)."""
    a: PoolAutoscaling = pool.autoscaling
    targets = a.model_dump(include=set(SUMMED.values()) | set(MEANS.values()))
    return {
        "min_replicas": a.min_workers,
        "max_replicas": a.max_workers,
        "initial_replicas": min(max(pool.num_workers, a.min_workers), a.max_workers),
        "upscale_delay_s": a.upscale_delay_s,
        "downscale_delay_s": a.downscale_delay_s,
        "look_back_period_s": a.look_back_period_s,
        "policy": {"policy_function": POLICY, "policy_kwargs": {"role": role, "targets": targets}},
    }
