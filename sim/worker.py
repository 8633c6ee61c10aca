"""One simulated worker: kvray's real `Scheduler` over a real `KVCacheManager`, with a
step-time model where the model forward would be.

A step is `schedule()` now and `update_from_output()` when the step-time model says the
forward is done; the sampled token is a stand-in (requests are `ignore_eos` with
`max_tokens` = their output length, so only the count matters). Prefill workers hold a
finished prompt's blocks through the real `KVHandoff` until the decode side has
pulled them; decode workers reserve blocks for a pull (or wait for room while the
prefill's pin lasts, or recompute) and admit the request when it lands, as
`LLMEngine.add_prefilled_request` / `handoff_step` / `finish_kv_pull` do. Every time the
hand-off reads is the simulation's (`clock`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from kvray.engine.config import EngineConfig
from kvray.engine.kv_cache_manager import KVCacheManager
from kvray.engine.kv_handoff import KVHandoff, LeasePolicy
from kvray.engine.request import Request
from kvray.engine.sampling_params import SamplingParams
from kvray.engine.scheduler import Policy, Scheduler, SchedulerOutput
from kvray.sim.cost_model import RequestWork, StepTimeModel

Role = Literal["prefill", "decode", "mixed"]
Admission = Literal["pull", "wait", "recompute"]  # what a decode worker does with a prefilled request
STAND_IN_TOKEN = 1  # what every simulated step "samples"
# a prefill's pin is let go when the decode side has pulled it or given up (which it does
# `pull_margin_s` before the ticket's deadline), never by lease: the cluster keeps the
# ticket's deadline (`ClusterSpec.lease`) on the simulated clock
LEASE_S = math.inf
# the context length of an engine whose `max_model_len` is None (the model's own, which the
# simulator does not load); the engine too takes 2048 for a model config that states none
MODEL_LEN_FALLBACK = 2048


@dataclass(frozen=True)
class SimEngineConfig:
    """The engine arguments that shape scheduling (vLLM's names)."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    policy: Policy = "fcfs"

    def __post_init__(self) -> None:
        if self.num_blocks * self.block_size < self.max_model_len:  # the runner refuses it too
            raise ValueError(
                f"num_blocks: {self.num_blocks} blocks of {self.block_size} tokens hold less than one "
                f"max_model_len ({self.max_model_len}) request: more memory, a larger tp or a shorter context"
            )

    @classmethod
    def from_engine(
        cls, engine: EngineConfig, num_blocks: int, model_len: int = MODEL_LEN_FALLBACK
    ) -> SimEngineConfig:
        """What an engine run with `engine` schedules by, over `num_blocks` KV blocks (what
        its runner sizes at start-up, so it travels apart from the config); `model_len`:
        the model's own context, for an engine whose `max_model_len` is None."""
        return cls(
            num_blocks=num_blocks,
            block_size=engine.block_size,
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_model_len=engine.max_model_len or model_len,
            enable_prefix_caching=engine.enable_prefix_caching,
            policy=engine.scheduling_policy,
        )


def batch_of(out: SchedulerOutput) -> list[RequestWork]:
    """The step's work, as the cost model reads it."""
    return [RequestWork(*work) for work in out.shape()]


class SimWorker:
    def __init__(
        self,
        worker_id: str,
        role: Role,
        engine: SimEngineConfig,
        cost: StepTimeModel,
        *,
        clock: Callable[[], float],
        lease: LeasePolicy,
    ):
        self.worker_id = worker_id
        self.role = role
        self.engine = engine
        self.cost = cost
        self.clock = clock  # the simulation's now
        self.kv = KVCacheManager(engine.num_blocks, engine.block_size, engine.enable_prefix_caching)
        # the engine's own hand-off state: a prefill's pins, a decode worker's pulls and waits
        self.handoff = KVHandoff(self.kv, engine.block_size, replace(lease, lease_s=LEASE_S))
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_model_len=engine.max_model_len,
            policy=engine.policy,
            connector=self.handoff,
        )
        self.step: SchedulerOutput | None = None  # the step in flight
        self.busy_s = 0.0  # seconds spent stepping (utilisation)
        self.num_steps = 0

    def new_request(
        self, request_id: str, prompt_token_ids: list[int], max_tokens: int, arrival_s: float
    ) -> Request:
        return Request(
            request_id,
            prompt_token_ids,
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            frozenset(),
            self.engine.block_size,
            arrival_time=arrival_s,
        )

    def add(self, request: Request) -> None:
        """Queue a request to compute here (its prompt, and its outputs unless prefill)."""
        if self.role == "prefill":
            self.handoff.expect(request.request_id)
        self.scheduler.add_request(request)

    # ---- the decode side of a hand-off ------------------------------------------------

    def reserve_pull(self, request: Request, pin_end: float) -> Admission:
        """A prefilled request (its first token already appended) whose prefill's pin lasts
        until `pin_end`, as `LLMEngine.add_prefilled_request` takes it: "pull" when blocks
        are reserved (call `land_pull` when the bytes arrive); "wait" while there is no room
        (`handoff_step` grants it some later, or sends it to recompute as the pin nears its
        end); "recompute" when the pin is too near its end to wait (queued here)."""
        if self.handoff.admit_prefilled(request, pin_end, self.clock()) is not None:
            return "pull"
        if self.handoff.waits(request.request_id):
            return "wait"
        self.scheduler.add_request(request)
        return "recompute"

    def handoff_step(self) -> list[tuple[str, list[int] | None]]:
        """Between steps, as `LLMEngine.handoff_step`: (request id, blocks to pull into) for
        each waiting request that got room, (request id, None) for one whose pin is about to
        lapse (queued here for recompute). No room goes out while a preempted request waits
        to come back."""
        may_allocate = not any(r.num_preemptions for r in self.scheduler.waiting)
        step = self.handoff.on_step(self.clock(), may_allocate)
        for req in step.recompute:
            self.scheduler.add_request(req)
        return step.rooms

    def land_pull(self, request_id: str) -> None:
        self.scheduler.add_running(self.handoff.finish_pull(request_id, ok=True))

    def release_pin(self, request_id: str) -> None:
        """The prefill side: the decode worker has the blocks."""
        self.handoff.release(request_id)

    # ---- stepping ---------------------------------------------------------------------

    @property
    def stepping(self) -> bool:
        return self.step is not None

    def start_step(self) -> float | None:
        """Schedule the next step; its seconds, or None when there is nothing to run."""
        if self.step is not None or not self.scheduler.has_unfinished():
            return None
        out = self.scheduler.schedule()
        if not out.requests:
            return None
        self.step = out
        seconds = self.cost.predict(batch_of(out))
        self.busy_s += seconds
        self.num_steps += 1
        return seconds

    def finish_step(self) -> list[Request]:
        """The forward is done: every request that reached its last token gets one; returns
        the requests that got a token (finished ones included)."""
        out, self.step = self.step, None
        sampled = {r.request_id: [STAND_IN_TOKEN] for i, r in enumerate(out.requests) if out.samples(i)}
        return self.scheduler.update_from_output(out, sampled)

    # ---- what the router sees ---------------------------------------------------------

    @property
    def num_requests(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting) + self.handoff.num_pulling

    @property
    def kv_usage(self) -> float:
        return self.kv.stats().usage
