"""Iteration-level scheduler (vLLM v1's rule): no prefill or decode phase, only tokens.

Every request has `num_computed_tokens` catching up with `num_tokens`. Each step hands
out a budget of `max_num_batched_tokens` over at most `max_num_seqs` requests: running
requests first (a decode needs one token, an unfinished prompt a chunk), then waiting
ones, whose prompts are chunked to fit what is left. When blocks run out, the
lowest-ranked running request is preempted: its blocks are freed and it recomputes
later (its full blocks usually come back from the prefix cache).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvray.engine.kv_cache_manager import KVCacheManager
from kvray.engine.request import Request, RequestStatus

Policy = Literal["fcfs", "priority", "deadline"]


class KVConnectorScheduler(Protocol):
    """What the scheduler asks at each finish (engine/kv_handoff.py answers)."""

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """`request` has just finished (its status says how): True to keep its blocks
        (they become the connector's), False to let the scheduler free them."""
        ...


POLICY_KEYS: dict[str, Callable[[Request], tuple]] = {
    "fcfs": lambda r: (r.arrival_time,),
    "priority": lambda r: (r.priority, r.arrival_time),
    "deadline": lambda r: (math.inf if r.deadline is None else r.deadline, r.arrival_time),
}


@dataclass
class SchedulerOutput:
    """One step's batch, in the order the model runner packs it."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)  # per request, drafts included
    preempted: list[Request] = field(default_factory=list)
    # per request: the proposed tokens it verifies this step (they come after its known
    # tokens, the last num_draft_tokens of its scheduled ones); [] for most
    draft_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def samples(self, i: int) -> bool:
        """Does request i reach its last known token this step (so it samples one)?"""
        r = self.requests[i]
        known = self.num_scheduled_tokens[i] - len(self.draft_token_ids[i])
        return r.num_computed_tokens + known == r.num_tokens

    def shape(self) -> list[tuple[int, int, bool]]:
        """Per request: (tokens computed this step, its context once they are, whether it
        samples) -- what a step costs, as kvray.sim's step-time model reads it. Call it
        before `update_from_output` moves the computed counts."""
        return [
            (n, r.num_computed_tokens + n, self.samples(i))
            for i, (r, n) in enumerate(zip(self.requests, self.num_scheduled_tokens))
        ]

    def add(self, request: Request, num_tokens: int, drafts: list[int] = ()) -> None:
        self.requests.append(request)
        self.num_scheduled_tokens.append(num_tokens)
        self.draft_token_ids.append(list(drafts))


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: Policy = "fcfs",
        connector: KVConnectorScheduler | None = None,
    ):
        """`connector`: asked at each finish whether the request's blocks must be held
        (a prefill whose KV a decode worker will pull)."""
        self.kv = kv_cache
        self.connector = connector
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.rank_key = POLICY_KEYS[policy]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Admit a request whose KV is already in its blocks (pulled from a prefill worker)."""
        self.requests[request.request_id] = request
        if len(self.running) < self.max_num_seqs:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=self.rank_key)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            # a decoding request verifies its drafts in the same step, as far as the budget goes
            drafts = req.spec_token_ids[: budget - n] if n == 1 else []
            while self.kv.allocate_slots(req, n + len(drafts)) is None:
                if drafts:  # never preempt anyone for drafts: run without them
                    drafts = []
                    continue
                victim = self.running.pop()  # lowest ranked
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            out.add(req, n + len(drafts), drafts)
            budget -= n + len(drafts)
            i += 1
        if not out.preempted:
            self._schedule_waiting(out, budget)
        now = time.monotonic()
        for req in out.requests:  # the first schedule ends its queue time (a preemption does not)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        return out

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # Requests that already hold their KV (pulled from a prefill worker) go first: they
        # need one token's room at most, and their blocks are stuck until they run.
        self.waiting.sort(key=lambda r: (not self.kv.block_ids(r.request_id), self.rank_key(r)))
        admitted = []
        for req in self.waiting:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if req.group is not None and req.sample_index > 0 and not req.group.prompt_done:
                continue  # waits for sample 0 to put the prompt in the prefix cache
            if self.kv.block_ids(req.request_id):  # holds pulled KV already: no lookup
                hits, num_hit_tokens = [], 0
            else:
                hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - req.num_computed_tokens - num_hit_tokens, budget)
            if self.kv.allocate_slots(req, n, hits) is None:
                break  # head of line waits for blocks
            req.num_computed_tokens += num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req)
            out.add(req, n)
            budget -= n
        if admitted:
            taken = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in taken]

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[str, list[int]],
        on_token: Callable[[Request, int], None] | None = None,
    ) -> list[Request]:
        """Advance computed counts and append each request's new tokens (its kept drafts,
        then one sampled token); returns the requests that got any. Requests that hit EOS,
        a stop token, max_tokens or max_model_len finish there, dropping later tokens.

        `on_token(request, j)` runs after the j-th new token is appended and checked (the
        engine's stop strings and grammar; it may finish the request). Drafts that were
        rejected are rolled back: their positions become uncomputed again, and blocks
        holding only such positions go back to the pool."""
        advanced, now = [], time.monotonic()
        for i, req in enumerate(out.requests):
            tokens = sampled.get(req.request_id)
            drafts = out.draft_token_ids[i]
            rejected = len(drafts) - (len(tokens) - 1) if tokens and drafts else 0
            req.num_computed_tokens += out.num_scheduled_tokens[i] - rejected
            req.spec_token_ids = []
            if rejected and not req.finished:
                self.kv.trim(req, req.num_computed_tokens)
            if tokens is None:
                continue
            if req.group is not None and req.sample_index == 0:
                req.group.prompt_done = True
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            for j, token in enumerate(tokens):
                req.append_token(token)
                reason = self.stop_reason(req)
                if reason is not None:
                    self.finish(req, reason)
                if on_token is not None:
                    on_token(req, j)
                if req.finished:
                    break
            advanced.append(req)
        return advanced

    def stop_reason(self, req: Request) -> RequestStatus | None:
        params = req.sampling_params
        token = req.output_token_ids[-1]
        if req.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_set:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop, length, abort) and release its blocks at once."""
        if req.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = status
        held = self.connector is not None and self.connector.request_finished(
            req, self.kv.block_ids(req.request_id)
        )
        if held:
            self.kv.detach(req)  # the connector owns the blocks now
        else:
            self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                aborted.append(req)
        return aborted
