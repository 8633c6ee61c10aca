"""The engine's side of speculative decoding: drafts before each step, accounting after.

Called by `LLMEngine.step` in this order:

    propose(running)        decoding requests get drafts (an n-gram proposer's tokens), or
                            places for them (-1: a draft model runs once slots exist)
    Scheduler.schedule()    drafts become part of the request's chunk, cut to the budget
    fill(step)              the draft model's proposals go into the reserved places
    ModelRunner.execute     the target verifies them (rejection_sampler.verify)
    Scheduler.update_from_output   kept drafts appended, rejected ones rolled back
    settle(step, sampled)   counters, and the draft model's cache follows the rollback
"""

from __future__ import annotations

from kvray.engine.draft_proposer import DraftProposer
from kvray.engine.kv_cache_manager import KVCacheManager
from kvray.engine.request import Request
from kvray.engine.scheduler import SchedulerOutput
from kvray.engine.spec_decode import NgramProposer, SpecDecodeStats, SpeculativeConfig


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, drafter: DraftProposer | None = None):
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.ngram = NgramProposer(config) if config.method == "ngram" else None
        self.drafter = drafter
        self.stats = SpecDecodeStats()

    def propose(self, running: list[Request]) -> None:
        """Drafts for every decoding request, as many as its limits leave room for: the
        step emits at most drafts + 1 tokens, within max_tokens and max_model_len."""
        for req in running:
            if req.num_tokens - req.num_computed_tokens != 1:
                continue  # prefilling (or catching up after a preemption)
            p = req.sampling_params
            room = self.max_model_len - req.num_tokens - 1
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - req.num_output_tokens - 1)
            k = max(min(self.k, room), 0)
            if self.drafter is not None:
                req.spec_token_ids = [-1] * k
            else:
                req.spec_token_ids = _grammar_cut(req, self.ngram.propose(req.all_token_ids, k))

    def fill(self, step: SchedulerOutput, kv: KVCacheManager) -> None:
        """The draft model's proposals into the step's reserved places (cut where a
        request's grammar refuses one: the step then runs fewer tokens)."""
        picked = [i for i, d in enumerate(step.draft_token_ids) if d]
        if self.drafter is None or not picked:
            return
        reqs = [step.requests[i] for i in picked]
        tables = [kv.block_ids(r.request_id) for r in reqs]
        proposals = self.drafter.propose(reqs, tables, [len(step.draft_token_ids[i]) for i in picked])
        for i, req, drafts in zip(picked, reqs, proposals):
            cut = _grammar_cut(req, drafts)
            step.num_scheduled_tokens[i] += len(cut) - len(drafts)
            step.draft_token_ids[i] = req.spec_token_ids = cut
            if len(cut) < len(drafts):  # the places of the cut drafts go back
                kv.trim(req, req.num_computed_tokens + step.num_scheduled_tokens[i])

    def settle(self, step: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """After the step's tokens are appended: count drafts kept, and let the draft
        model's cache forget positions the target rolled back."""
        for req, drafts in zip(step.requests, step.draft_token_ids):
            if drafts and req.request_id in sampled:  # (not one whose row failed: it has ended)
                self.stats.record(len(drafts), len(sampled[req.request_id]) - 1)
            if self.drafter is not None:
                self.drafter.settle(req)

    def forget(self, request_id: str) -> None:
        if self.drafter is not None:
            self.drafter.forget(request_id)


def _grammar_cut(req: Request, drafts: list[int]) -> list[int]:
    """The leading drafts a constrained request's grammar accepts."""
    return drafts[: req.grammar.num_valid(drafts)] if req.grammar is not None and drafts else drafts
