"""A worker's load signals for autoscaling: what its queues hold now and how fast it has
been answering lately (means over a sliding window, so a read never drains anything)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

from kvray.engine.engine_stats import EngineStats

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


@dataclass(frozen=True)
class LoadSignals:
    """A worker's load: its engine's queues now (prompt tokens not yet computed, requests
    admitted or waiting, the share of KV blocks in use, the KV hand-offs it holds:
    prefilled prompts pinned for a decode worker, pulls arriving), and its latencies
    lately. The field names are the autoscaling signals' (router/autoscaling.py)."""

    queued_prompt_tokens: float
    running_requests: float
    kv_cache_usage: float
    kv_handoffs: float
    ttft_seconds: float
    itl_seconds: float

    @classmethod
    def of(cls, stats: EngineStats, ttft_seconds: float, itl_seconds: float) -> LoadSignals:
        return cls(
            queued_prompt_tokens=float(stats.queued_prompt_tokens),
            running_requests=float(stats.num_running + stats.num_waiting),
            kv_cache_usage=float(stats.kv.usage),
            kv_handoffs=float(stats.num_pinned + stats.num_pulling),
            ttft_seconds=ttft_seconds,
            itl_seconds=itl_seconds,
        )

    def metrics(self) -> dict[str, float]:
        """As Serve's custom autoscaling metrics (`record_autoscaling_stats`) take them."""
        return asdict(self)
