"""A worker's outgoing token path: per front, the deltas of its requests, streamed as one
list per engine step (or per several steps, when the front reads slower than they come).

The engine thread hands the outbox all outputs of a step in one call on the worker's loop
(`put_many`, an `OutputSink`); the outbox turns each into a `Delta` and appends it to its
front's pending list, and the front's `outputs` stream (`stream`) yields whatever has
piled up as one Ray object. A request registers its front before the engine sees it, so no
output can come before its destination is known.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from kvray.actors.messages import Delta, DeltaInfo
from kvray.actors.request_spans import record_engine_spans
from kvray.actors.signals import RecentMean
from kvray.engine import RequestOutput
from kvray.tracing import Tracing


class Outbox:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        price_per_hour: float = 0.0,
        tracing: Tracing | None = None,
        attributes: dict | None = None,
    ):
        """`tracing` (None: off): a traced request's engine spans are recorded as it
        finishes here, with `attributes` (the worker's)."""
        self.loop = loop
        self.tracing = tracing
        self.attributes = attributes or {}
        # request id -> (its trace context, the phases it runs here): traced requests only
        self.traces: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {}
        self.price_per_second = price_per_hour / 3600.0
        self.destination: dict[str, str] = {}  # request id -> the front that owns it
        self.pending: dict[str, list[Delta]] = {}  # front -> deltas not yet streamed
        self.wakeup: dict[str, asyncio.Event] = {}  # front -> set when pending has some
        self.num_streamed = 0  # deltas handed to fronts (for the plane benchmark)
        self.last_token: dict[str, float] = {}  # request id -> when it last made tokens here
        self.ttft = RecentMean()  # arrival here -> first token (autoscaling signals)
        self.itl = RecentMean()  # seconds between a request's tokens

    def register(
        self, request_id: str, destination: str, trace: dict[str, str] | None = None, prefilled: bool = False
    ) -> None:
        """Stream `request_id`'s deltas to `destination`; `trace`: its trace context when
        traced (`prefilled`: its queue and prefill ran on a prefill worker)."""
        self.destination[request_id] = destination
        self.last_token[request_id] = -time.monotonic()  # negative: no token yet
        if trace is not None and self.tracing is not None:
            self.traces[request_id] = (trace, ("decode",) if prefilled else ("queue", "prefill", "decode"))
        self._front(destination)

    def unregister(self, request_id: str) -> None:
        """The engine refused the request: nothing will come for it."""
        self.destination.pop(request_id, None)
        self.last_token.pop(request_id, None)
        self.traces.pop(request_id, None)

    def requests_of(self, destination: str) -> list[str]:
        return [rid for rid, d in self.destination.items() if d == destination]

    def push(self, delta: Delta) -> None:
        """Queue one delta for its request's front (on the loop)."""
        destination = self.destination.get(delta.request_id)
        if destination is None:  # already finished (or never registered)
            return
        self._time(delta)
        if delta.finish_reason is not None:
            del self.destination[delta.request_id]
            del self.last_token[delta.request_id]
            self.traces.pop(delta.request_id, None)
        pending = self.pending.get(destination)
        if pending is not None:  # (None: its front is gone, its stream ending)
            pending.append(delta)
            self.wakeup[destination].set()

    def _time(self, delta: Delta) -> None:
        if not delta.token_ids:
            return
        now, last = time.monotonic(), self.last_token[delta.request_id]
        if last < 0:
            self.ttft.record(now + last)
        else:
            self.itl.record((now - last) / len(delta.token_ids))
        self.last_token[delta.request_id] = now

    # ---- OutputSink: called on the loop by the engine thread, once per step -------------

    def put_many(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.outputs:
                self.push(self._delta(out))

    def fail(self, request_ids: list[str], error: BaseException) -> None:
        """The engine can no longer serve (EngineDeadError): each request's front gets a
        last delta saying so and moves the request to another worker, as if this worker
        had died. Nothing more goes out for them from here."""
        for rid in request_ids:
            destination = self.destination.pop(rid, None)
            self.last_token.pop(rid, None)
            self.traces.pop(rid, None)
            if destination is not None and destination in self.pending:
                self.pending[destination].append(
                    Delta(rid, [], "", None, None, None, DeltaInfo(worker_failed=str(error)))
                )
                self.wakeup[destination].set()

    def _delta(self, out: RequestOutput) -> Delta:
        c = out.outputs[0]
        info = None
        if out.prompt_token_ids is not None:  # the request's first output here
            queue = out.metrics.time_in_queue if out.metrics is not None else None
            info = DeltaInfo(queue_seconds=queue, num_cached_tokens=out.num_cached_tokens)
        if c.finish_reason is not None:
            share = out.metrics.step_seconds if out.metrics is not None else 0.0
            info = (info or DeltaInfo())._replace(cost_usd=self.price_per_second * share)
            traced = self.traces.pop(out.request_id, None)
            if traced is not None and out.metrics is not None:
                record_engine_spans(self.tracing, traced[0], out.metrics, self.attributes, traced[1])
        return Delta(out.request_id, c.token_ids, c.text, c.logprobs, c.finish_reason, c.stop_reason, info)

    # ---- the front's side ---------------------------------------------------------------

    async def stream(self, destination: str) -> AsyncIterator[list[Delta]]:
        """Every delta for `destination`, in order, batched by what piled up meanwhile.
        Runs until the front cancels it (or the worker goes away)."""
        wakeup = self._front(destination)
        while True:
            await wakeup.wait()
            wakeup.clear()
            batch = self.pending.get(destination)
            if batch is None:  # closed meanwhile
                return
            self.pending[destination] = []
            if batch:
                self.num_streamed += len(batch)
                yield batch

    def end(self, destination: str) -> None:
        """End the front's stream (it is gone); `close` follows as the stream returns."""
        if destination in self.wakeup:
            self.pending.pop(destination, None)
            self.wakeup[destination].set()

    def close(self, destination: str) -> list[str]:
        """The front's stream ended: forget it; returns its requests still in flight."""
        orphans = self.requests_of(destination)
        for rid in orphans:
            del self.destination[rid]
            del self.last_token[rid]
            self.traces.pop(rid, None)
        self.pending.pop(destination, None)
        self.wakeup.pop(destination, None)
        return orphans

    def _front(self, destination: str) -> asyncio.Event:
        if destination not in self.wakeup:
            self.wakeup[destination] = asyncio.Event()
            self.pending[destination] = []
        return self.wakeup[destination]
