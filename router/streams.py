"""Async plumbing of the ingress: SSE framing, interleaving several output streams, and
awaiting a batch of requests that all stop when one fails or the client goes away."""

from __future__ import annotations

import asyncio
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
