"""One simulated worker: kvray's real `Scheduler` over a real `KVCacheManager`, with a
step-time model where the model forward would be.

A step is `schedule()` now and `update_from_output()` when the step-time model says the
forward is done; the sampled token is a stand-in (requests are `ignore_eos` with
`max_tokens` = their output length, so only the count matters). Prefill workers hold a
finished prompt's blocks through the real `KVHandoff` until the decode side has
pulled them; decode workers reserve blocks for a pull and admit the request when it
lands, as `LLMEngine.add_prefilled_request` / `finish_kv_pull` do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvray.engine.kv_cache_manager import KVCacheManager
from kvray.engine.kv_handoff import KVHandoff, LeasePolicy
from kvray.engine.request import Request
from kvray.engine.sampling_params import SamplingParams
from kvray.engine.scheduler import Policy, Scheduler, SchedulerOutput
from kvray.sim.cost_model import RequestWork, StepTimeModel

Role = Literal["prefill", "decode", "mixed"]
STAND_IN_TOKEN = 1  # what every simulated step "samples"
LEASE_S = 1e9  # the simulator releases a pin when its pull lands, never by lease


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


def batch_of(out: SchedulerOutput) -> list[RequestWork]:
    """The step's work, as the cost model reads it."""
    return [RequestWork(*work) for work in out.shape()]


class SimWorker:
    def __init__(self, worker_id: str, role: Role, engine: SimEngineConfig, cost: StepTimeModel):
        self.worker_id = worker_id
        self.role = role
        self.engine = engine
        self.cost = cost
        self.kv = KVCacheManager(engine.num_blocks, engine.block_size, engine.enable_prefix_caching)
        # the engine's own hand-off state: a prefill's pins, a decode worker's pulls
        self.handoff = KVHandoff(self.kv, engine.block_size, LeasePolicy(lease_s=LEASE_S))
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

    def reserve_pull(self, request: Request) -> bool:
        """Blocks for a prefilled request's prompt KV (its first token already appended):
        True when reserved (call `land_pull` when the bytes arrive); False when there is no
        room, and the prompt is queued for recompute here instead."""
        if self.handoff.admit_prefilled(request, pin_end=None) is None:  # (the engine waits for room)
            self.scheduler.add_request(request)
            return False
        return True

    def land_pull(self, request_id: str) -> None:
        self.scheduler.add_running(self.handoff.finish_pull(request_id, ok=True))

    def release_pin(self, request_id: str) -> None:
        """The prefill side: the decode worker has the blocks."""
        self.handoff.release(request_id)

    # ---- stepping ---------------------------------------------------------------------

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
