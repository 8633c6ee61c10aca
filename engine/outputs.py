"""What the engine returns: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

FinishReason = Literal["stop", "length", "abort", "error"]  # error: it alone failed (logged)


class TokenLogprobs(NamedTuple):
    """One sampled token's logprobs as the sampler makes them, and as they travel (a
    prefill worker's first token to its decode worker); a RequestOutput shows them as
    vLLM's {token id: Logprob} entry (`entry`)."""

    logprob: float  # the sampled token's
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]  # the k most likely (token id, logprob), best first

    def entry(self, token: int) -> dict[int, Logprob]:
        found = {tid: Logprob(v, r + 1) for r, (tid, v) in enumerate(self.top)}
        found.setdefault(token, Logprob(self.logprob, self.rank))
        return found

    @classmethod
    def of(cls, token: int, entry: dict[int, Logprob], k: int) -> TokenLogprobs:
        """Back from an output's entry for `token`, its top `k` (rank order)."""
        top = [(t, e.logprob) for t, e in sorted(entry.items(), key=lambda kv: kv[1].rank)]
        return cls(entry[token].logprob, entry[token].rank, top[:k])


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int  # which of the n samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per generated token
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When the engine got and first scheduled a request (part of vLLM's RequestMetrics).
    Monotonic seconds of the engine's own process: elsewhere only differences mean anything."""

    arrival_time: float
    first_scheduled_time: float | None = None  # None: still waiting for its first step
    # the request's share of the engine's step time so far: each step's wall time split
    # evenly over the requests it ran (what a worker's price is charged by)
    step_seconds: float = 0.0
    first_token_time: float | None = None  # the first output token of any of its samples
    last_token_time: float | None = None  # the latest output token of any of its samples

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival to the first step that scheduled it (vLLM's queue time)."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        """Seconds from the first output token to the latest (what TPOT is measured over)."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # None on a DELTA request's outputs after its first
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None  # None where no engine made the output
