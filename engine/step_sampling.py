"""A step's sampling, with one request's failure kept to that request.

Every sampling request's tokens come from one batched pass (`Sampler`, or `verify` for
requests with drafts). Should that pass raise, it is redone one request at a time from
the random state it started from (the seeded requests' generators are put back): the
requests whose own rows fail get an error in `StepResult.errors` and no tokens, and the
others get the tokens the batched pass would have given them. The engine then ends the
failed requests alone (LLMEngine.step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvray.engine.rejection_sampler import verify
from kvray.engine.sampler import Sampler, SamplerOutput, SampleRow

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    request_ids: list[str]  # requests that sampled, in batch order
    token_ids: list[list[int]]  # per request: kept drafts, then one sampled token
    logprobs: list[list]  # per token, as SamplerOutput.logprobs
    # requests whose own rows failed (their grammar's mask, their sampling): request id ->
    # the cause. Their tokens above are none; the engine ends them alone, the batch goes on.
    errors: dict[str, str] = field(default_factory=dict)

    @classmethod
    def plain(cls, request_ids: list[str], out: SamplerOutput) -> StepResult:
        return cls(request_ids, [[t] for t in out.token_ids], [[lp] for lp in out.logprobs])


def sample_step(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SampleRow],
    request_ids: list[str],
    drafts: list[list[int]] | None,
    greedy: torch.Tensor | None = None,
) -> StepResult:
    """logits [len(rows), V]: request i's rows are consecutive (its drafts + 1 of them);
    `greedy`: each row's argmax where the caller has it (Sampler.__call__)."""
    saved = sampler.save_generators(rows)
    try:
        if drafts is None:
            return StepResult.plain(request_ids, sampler(logits, rows, greedy))
        verified = verify(sampler, logits, rows, drafts)
        return StepResult(request_ids, verified.token_ids, verified.logprobs)
    except Exception as e:
        logger.warning("kvray engine: sampling the batch failed (%s); sampling each request alone", cause(e))
        sampler.restore_generators(saved)
    result = StepResult(request_ids, [], [])
    start = 0
    for rid, d in zip(request_ids, drafts or [[] for _ in request_ids]):
        mine = slice(start, start + len(d) + 1)
        start = mine.stop
        try:
            if drafts is None:
                out = StepResult.plain([rid], sampler(logits[mine], rows[mine]))
            else:
                v = verify(sampler, logits[mine], rows[mine], [d])
                out = StepResult([rid], v.token_ids, v.logprobs)
        except Exception as e:
            logger.error("kvray engine: request %s failed in sampling: %s", rid, cause(e))
            result.errors[rid] = cause(e)
            out = StepResult([rid], [[]], [[]])
        result.token_ids += out.token_ids
        result.logprobs += out.logprobs
    return result


def cause(e: BaseException) -> str:
    """How a failure is recorded (and logged with its request's id; never sent to a client)."""
    return f"{type(e).__name__}: {e}"
