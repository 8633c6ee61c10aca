"""The prefill role: run the prompt (chunked, prefix-cached), sample the first token and
return it with a KVTicket (`prefill`, a unary call). The prompt's blocks stay pinned until
the decode side confirms its pull (`release_kv`) or the lease ends.

This is the serving half of a KV hand-off: the decode worker's connector pulls through
this worker's `KVSource` (and, for a sharded worker, through its shards' sources).
"""

from __future__ import annotations

import asyncio
import time

import torch

from kvray.actors.kv_transport import KVServing, KVSource
from kvray.actors.messages import TRANSFER_BUCKETS, EngineRequest, PrefillResult
from kvray.actors.request_spans import record_engine_spans
from kvray.actors.signals import RecentMean
from kvray.actors.worker import EngineWorker, Role
from kvray.engine.kv_transfer import prefill_params
from kvray.engine.outputs import TokenLogprobs
from kvray.errors import RequestFailedError


class PrefillWorker(KVServing, EngineWorker):
    role: Role = "prefill"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        llm = self.llm
        self.source = KVSource(llm.kv_views, llm.kv_layout)
        self.ttft = RecentMean()  # seconds from arrival here to the first token

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        """Run the prompt and sample its first token; the blocks stay pinned for a pull."""
        self._check_accepting(req.request_id)
        start = time.monotonic()
        rid = req.request_id
        prompt = {"prompt_token_ids": req.prompt_token_ids}
        stream = await self.llm.add_request(
            rid, prompt, prefill_params(req.params), req.priority, pin_kv=True
        )
        final = None
        handed_off = False
        try:
            async for out in stream:
                final = out
            if final.outputs[0].finish_reason == "error":  # its own rows failed (logged here)
                raise RequestFailedError(
                    f"request {rid} failed on its prefill worker (the cause is in its log)"
                )
            if final.outputs[0].finish_reason == "abort" or not final.outputs[0].token_ids:
                raise RuntimeError(f"prefill of {rid} was aborted")
            self.ttft.record(time.monotonic() - start)
            ticket = await self.llm.kv_ticket(self.worker_id, rid)
            handed_off = True
        finally:
            if not handed_off:  # cancelled (the client left): stop it and let any pin go
                self.llm.abort(rid)
                self._start(self.llm.release_kv(rid))
        first = final.outputs[0]
        first_logprobs = None
        if first.logprobs:
            first_logprobs = TokenLogprobs.of(first.token_ids[0], first.logprobs[0], req.params.logprobs)
        metrics = final.metrics
        if self.tracing is not None and req.trace is not None and metrics is not None:
            record_engine_spans(self.tracing, req.trace, metrics, self.span_attributes, ("queue", "prefill"))
        return PrefillResult(
            rid,
            first.token_ids[0],
            first_logprobs,
            ticket,
            final.num_cached_tokens,
            queue_seconds=metrics.time_in_queue if metrics is not None else None,
            cost_usd=self.price_per_hour / 3600.0 * (metrics.step_seconds if metrics is not None else 0.0),
        )

    async def _abort(self, request_id: str) -> None:
        """The front gave up on the request (deadline, client gone): stop its prefill if it
        runs, and let its pin go if it has finished (no decode worker will pull it)."""
        self.llm.abort(request_id)
        await self.release_kv(request_id)

    def _ttft_mean(self) -> float:
        return self.ttft.mean()

    # ---- serving pulls --------------------------------------------------------------------

    async def release_kv(self, request_id: str) -> bool:
        """The decode side confirms its pull (or gives up): unpin the ticket's blocks."""
        self.llm.kv_views.unhold(request_id)
        return await self.llm.release_kv(request_id)

    async def hold_kv(self, request_id: str) -> list[int] | None:
        """A multi-shard pull is starting: keep the pin from expiring until `release_kv`
        (or the lease policy's `hold_s`, should the decode side vanish). None: lease over,
        or held already."""
        return self.llm.kv_views.hold(request_id)

    async def shard_handles(self) -> list:
        return self.shards

    async def export_kv(self, request_id: str) -> torch.Tensor | None:
        """object_store: the request's pinned blocks, packed (the driver holds the pins)."""
        return await self.source.export_kv(request_id)

    async def _transfer(self) -> tuple[int, float, list[int]]:
        shard_sent = 0  # KV bytes this worker's other shards sent to decode shards
        if self.shards:
            shard_sent = sum(await asyncio.gather(*(s.bytes_sent.remote() for s in self.shards)))
        return self.source.bytes_sent + shard_sent, 0.0, [0] * (len(TRANSFER_BUCKETS) + 1)
