"""What an engine reports of itself between steps: the last step's batch (`StepStats`) and
its state as a worker reports it (`EngineStats`, `engine_stats`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from kvray.engine.block_pool import KVCacheStats
from kvray.engine.spec_decode import SpecDecodeStats


@dataclass
class StepStats:
    num_batched_tokens: int
    num_running: int
    num_waiting: int


@dataclass(frozen=True)
class EngineStats:
    """What a worker reports of its engine (read between steps)."""

    num_running: int
    num_waiting: int
    queued_prompt_tokens: int  # prompt tokens admitted or waiting, not yet computed
    kv: KVCacheStats
    num_pinned: int  # prefilled prompts held for a decode worker's pull
    num_pulling: int  # prompts whose KV is arriving here, or waits for blocks to arrive in
    num_kv_recomputes: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    spec_decode: SpecDecodeStats  # a copy: drafts verified, tokens proposed and kept


def engine_stats(engine) -> EngineStats:
    """`engine`'s (an LLMEngine's) stats now: read between steps, on its thread."""
    sched, handoff = engine.scheduler, engine.handoff
    requests = [*sched.waiting, *sched.running]
    return EngineStats(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting) + len(handoff.waiting),  # (those waiting to pull too)
        queued_prompt_tokens=sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in requests),
        kv=engine.kv.stats(),
        num_pinned=handoff.num_pinned,
        num_pulling=handoff.num_pulling,
        num_kv_recomputes=handoff.num_recomputes,
        prefix_queries=engine.kv.prefix_queries,
        prefix_hits=engine.kv.prefix_hits,
        num_preemptions=sched.num_preemptions,
        spec_decode=copy.deepcopy(engine.spec_stats),
    )
