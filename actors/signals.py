"""A worker's load signals for autoscaling: what its queues hold now and how fast it has
been answering lately (means over a sliding window, so a read never drains anything)."""

from __future__ import annotations

import time
from collections import deque

WINDOW_S = 30.0


class RecentMean:
    """The mean of the values recorded in the last `window_s` seconds (0 when none)."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.samples: deque[tuple[float, float]] = deque()

    def record(self, value: float) -> None:
        self.samples.append((time.monotonic(), value))

    def mean(self) -> float:
        cutoff = time.monotonic() - self.window_s
        while self.samples and self.samples[0][0] < cutoff:
            self.samples.popleft()
        return sum(v for _, v in self.samples) / len(self.samples) if self.samples else 0.0


def engine_load(engine) -> dict[str, float]:
    """Queue signals of an engine (read on its loop thread): prompt tokens not yet
    computed, requests admitted or waiting, the share of KV blocks in use, and the KV
    handoffs it holds (prefilled prompts pinned for a decode worker, pulls arriving)."""
    sched = engine.scheduler
    requests = [*sched.waiting, *sched.running]
    queued = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in requests)
    return {
        "queued_prompt_tokens": float(queued),
        "running_requests": float(len(requests)),
        "kv_cache_usage": float(engine.kv_cache_stats().usage),
        "kv_handoffs": float(len(engine.pins) + len(engine.kv_pulls)),
    }
