"""A pool's size from kvray.sim's planner, for the autoscaling policy's `planner:` block.

The app's request rate and mean prompt and output lengths come from the ingresses'
published request metrics (cumulative counts, differenced over `window_seconds`); what one
worker of the pool takes within the SLOs comes from `kvray.sim.planner` (a prefill worker as
an M/G/1 queue against the TTFT SLO, a decode worker as the largest batch whose step meets
the TPOT SLO) over a step-time model. Asking each pool for rate / capacity workers makes
the prefill:decode ratio follow the measured token rates.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from kvray.configs import PlannerConfig
from kvray.engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from kvray.sim.cost_model import HARDWARE, MODELS, StepTimeModel
from kvray.sim.planner import decode_rate, prefill_rate
from kvray.sim.worker import SimEngineConfig


def request_totals(app_name: str) -> tuple[float, float, float]:
    """(finished requests, their prompt tokens, their output tokens) over every ingress."""
    from kvray.router import metrics

    total = metrics.merge(metrics.published(app_name))
    return (
        float(sum(total["success"].values())),
        float(total["count"].get("prompt_tokens", 0)),
        float(total["count"].get("generation_tokens", 0)),
    )


def step_model(cfg: PlannerConfig) -> StepTimeModel:
    if cfg.profile:
        fitted = StepTimeModel.from_dict(json.loads(Path(cfg.profile).read_text())["fit"])
        return replace(fitted, tp=cfg.tp)
    return StepTimeModel(MODELS[cfg.model], HARDWARE[cfg.gpu], tp=cfg.tp)


class PlannerSizing:
    def __init__(
        self,
        role: str,
        planner: dict,
        engine: dict,
        totals: Callable[[], tuple[float, float, float]],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.role = role
        self.cfg = PlannerConfig(**planner)
        self.cost = step_model(self.cfg)
        e = EngineConfig(**engine)
        if self.cfg.profile:  # a CPU profile: the engine's KV budget in bytes
            num_blocks = self.cost.blocks_in(e.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES, e.block_size)
        else:
            num_blocks = self.cost.kv_cache_blocks(e.block_size, e.gpu_memory_utilization)
        self.engine = SimEngineConfig.from_engine(e, int(num_blocks))
        self.totals = totals
        self.clock = clock
        self.history: deque[tuple[float, tuple[float, float, float]]] = deque()

    def ask(self) -> int | None:
        """Workers this pool needs for the rate of the last window: one after a whole
        window in which no request finished (idle), None before the first window has
        either (the pool's other signals decide meanwhile)."""
        now = self.clock()
        self.history.append((now, self.totals()))
        while len(self.history) > 2 and now - self.history[1][0] >= self.cfg.window_seconds:
            self.history.popleft()
        (t0, (r0, p0, o0)), (t1, (r1, p1, o1)) = self.history[0], self.history[-1]
        if t1 - t0 <= 0 or r1 <= r0:
            return 1 if t1 - t0 >= self.cfg.window_seconds else None
        rate = (r1 - r0) / (t1 - t0)
        prompt, output = (p1 - p0) / (r1 - r0), (o1 - o0) / (r1 - r0)
        per_worker = self.per_worker(prompt, output)
        return math.ceil(rate / per_worker) if per_worker > 0 else None

    def per_worker(self, prompt: float, output: float) -> float:
        """Requests/s one worker of this pool takes within the SLOs."""
        prefill = prefill_rate(self.cost, self.engine, [max(1, round(prompt))], 1, self.cfg.ttft_seconds)
        decode = decode_rate(self.cost, self.engine, prompt + output / 2, output, 1, self.cfg.tpot_seconds)
        if self.role == "prefill":
            return prefill
        if self.role == "decode":
            return decode
        return 1 / (1 / prefill + 1 / decode) if prefill > 0 and decode > 0 else 0.0  # mixed: both
