"""Async plumbing of the ingress: SSE framing, interleaving several output streams,
awaiting a batch of requests that all stop when one fails or the client goes away, and
watching a non-streaming client's connection."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator


async def sse(gen: AsyncIterator[dict]) -> AsyncIterator[str]:
    """OpenAI's server-sent events: `data: {json}` per chunk, then `data: [DONE]`."""
    try:
        async for chunk in gen:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await gen.aclose()  # a client that left: close the streams, which aborts their requests


async def merge(streams: list) -> AsyncIterator[tuple[int, object]]:
    """Interleave several output streams as (stream index, output); closing it cancels them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, stream):
        try:
            async for out in stream:
                queue.put_nowait((index, out, None))
            queue.put_nowait((index, None, None))
        except Exception as e:
            queue.put_nowait((index, None, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                remaining -= 1
                continue
            yield index, out
    finally:
        for t in tasks:
            t.cancel()


async def all_or_none(coroutines: list) -> list:
    """Await them all; when one fails (or we are cancelled), cancel the rest, then raise."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def _disconnected(request) -> None:
    """Returns once the client has gone (after its body was read, the ASGI server's next
    message is the disconnect); never, where the server cannot say."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.05)  # (a server that repeats its messages: do not spin)
    except Exception:  # noqa: BLE001 (no way to watch: never fire)
        await asyncio.Event().wait()


async def unless_disconnected(request, work):
    """Await `work`, or cancel it when the client disconnects first (the requests it runs
    are aborted on every worker they touched). None when the client has gone."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    finally:
        task.cancel()
        watch.cancel()
