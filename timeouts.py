"""`wait_for`: asyncio.wait_for without its cancellation bug.

On Python 3.10 and 3.11, `asyncio.wait_for` loses a cancellation that reaches the caller
in the same loop tick as the awaited result (python/cpython#86296, fixed in 3.12): the
caller carries on as if never cancelled. A front reading a stream whose client has just
left hits that window often, and the request then runs to its end with nobody reading it.
`asyncio.wait` never absorbs the caller's cancellation, so this is built on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
    """Await it, or cancel it and raise TimeoutError after `timeout` seconds. If the
    caller is cancelled meanwhile, the awaited task is cancelled too and CancelledError
    propagates, whatever the timing."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except BaseException:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise TimeoutError(f"not done after {timeout} s")
    return task.result()
