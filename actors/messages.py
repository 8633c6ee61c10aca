"""What crosses between a front (the ingress that owns a request) and an engine worker.

A front sends an `EngineRequest` (token ids and typed parameters: it tokenized and
validated once); a prefill worker answers with a `PrefillResult`; every worker streams the
requests' progress back to the front that owns them as `Delta`s, one list per engine step
per front (`EngineWorker.outputs`). A delta holds only what is new: never the prompt, never
the text so far, so the bytes per streamed token do not grow with the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvray.engine import SamplingParams
from kvray.engine.kv_transfer import KVTicket
from kvray.engine.outputs import Logprob, TokenLogprobs
from kvray.engine.spec_decode import SpecDecodeStats

# seconds; the buckets of the per-pull `kvray:kv_transfer_seconds` histogram (+Inf beyond)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # one sample (the front fans `n` out); output_kind DELTA
    destination: str  # the front whose `outputs` stream gets this request's deltas
    # a request moved here after its worker died: the tokens it had streamed (recomputed
    # with the prompt; its deltas go on from the next token)
    generated_token_ids: list[int] = field(default_factory=list)
    priority: int = 0  # under scheduling_policy "priority": lower runs first (vLLM's)
    # the request's trace context (W3C `traceparent`) when it is traced (kvray/tracing.py):
    # the worker records its spans under it
    trace: dict[str, str] | None = None


@dataclass
class PrefillResult:
    """What a prefill hands to the front, for the decode worker."""

    request_id: str
    first_token: int
    first_logprobs: TokenLogprobs | None  # the first token's, when asked
    ticket: KVTicket | None  # None when the blocks could not be pinned
    num_cached_tokens: int
    queue_seconds: float | None = None  # the prefill engine's queue time: the request's
    cost_usd: float = 0.0  # the prefill worker's price x this request's share of its steps


class DeltaInfo(NamedTuple):
    """What a delta carries besides its tokens, now and then (most carry none)."""

    queue_seconds: float | None = None  # first delta: the engine's queue time
    num_cached_tokens: int | None = None  # first delta: prompt tokens the prefix cache had
    cost_usd: float = 0.0  # last delta: the worker's price x the request's share of its steps
    # the worker's engine can no longer serve (why): the request ends here and the front
    # moves it to another worker, as when a worker dies
    worker_failed: str | None = None

    def then(self, later: DeltaInfo | None) -> DeltaInfo:
        """This delta's info followed by a later one's (joined deltas: each field once)."""
        if later is None:
            return self
        return DeltaInfo(
            later.queue_seconds if later.queue_seconds is not None else self.queue_seconds,
            later.num_cached_tokens if later.num_cached_tokens is not None else self.num_cached_tokens,
            self.cost_usd + later.cost_usd,
            later.worker_failed or self.worker_failed,
        )


class Delta(NamedTuple):
    """One request's progress in one engine step (a tuple on the wire: compact to pickle)."""

    request_id: str
    token_ids: list[int]  # new tokens
    text: str  # new visible text (held back while it could still start a stop string)
    logprobs: list[dict[int, Logprob]] | None  # one entry per new token, when asked
    # "stop" | "length" | "abort" | "error" (it alone failed, logged there) on its last delta
    finish_reason: str | None
    stop_reason: int | str | None
    info: DeltaInfo | None = None  # the first's and the last's (DeltaInfo), else None


@dataclass
class WorkerStats:
    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    kv_usage: float  # used / total blocks
    used_blocks: int
    pinned: int  # tickets whose blocks are still pinned
    kv_transfer_bytes: int  # bytes pulled in (decode) plus bytes sent out (prefill)
    kv_transfer_seconds: float  # time spent pulling (decode side)
    # cumulative counts of KV pulls per bucket of TRANSFER_BUCKETS
    # (+Inf last): whoever reads the stats, each pull is counted once
    kv_pull_buckets: list[int] = field(default_factory=list)
    kv_recomputes: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    accepting: bool = True  # False once the worker is leaving (draining)
