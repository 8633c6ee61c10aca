"""Where an AsyncLLM's outputs go: one request's `OutputStream` (iterated with `async
for`), or a caller's `OutputSink` for all of its requests at once (an engine worker's
outbox). Both are fed on the caller's own event loop, scheduled from the engine thread."""

from __future__ import annotations

import asyncio
from typing import Protocol

from kvray.engine.outputs import RequestOutput


class OutputSink(Protocol):
    """Where the outputs of a caller's requests go: `put_many` and `fail` are called on the
    caller's `loop` (scheduled from the engine thread), once per step with all of them."""

    loop: asyncio.AbstractEventLoop

    def put_many(self, outputs: list[RequestOutput]) -> None: ...

    def fail(self, request_ids: list[str], error: BaseException) -> None: ...


class OutputStream:
    """One request's outputs, fed from the loop thread; iterate it with `async for`."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.finished = False
        self.loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def put_many(self, outputs: list[RequestOutput]) -> None:  # on self.loop
        for out in outputs:
            self._queue.put_nowait(out)

    def fail(self, request_ids: list[str], error: BaseException) -> None:  # on self.loop
        self._queue.put_nowait(error)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item
