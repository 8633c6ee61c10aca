"""A worker's `outputs` stream into one front, split into per-request mailboxes.

A worker sends one list of deltas per engine step for all of a front's requests on one
long-lived stream per (worker, front) pair; the front's `Inbox` for that worker hands each
delta to its request's `Mailbox`, and when the stream ends (the worker died or left) every
mailbox gets a `Gone`. `join` makes the deltas a reader took at once into one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import ray

from kvray.actors.messages import Delta
from kvray.errors import EngineDeadError


class Gone:
    """Put in a request's mailbox when its worker's stream ends."""

    def __init__(self, worker_id: str, error: BaseException | None):
        self.worker_id = worker_id
        self.error = error


class Mailbox:
    """One request's deltas as they arrive; `take` returns all that are there (waiting for
    at least one), so a reader that fell behind catches up in one piece."""

    def __init__(self):
        self.items: list[Delta | Gone] = []
        self.ready = asyncio.Event()

    def put(self, item: Delta | Gone) -> None:
        self.items.append(item)
        self.ready.set()

    async def take(self) -> list[Delta | Gone]:
        await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        return items


class Inbox:
    """One worker's `outputs` stream into this front, split into per-request mailboxes."""

    def __init__(
        self, front_id: str, worker_id: str, handle, on_close: Callable[[Inbox], None], front_handle=None
    ):
        """`front_handle`: the front's own actor handle, which the worker asks whether the
        front still lives (it aborts the front's requests when it does not)."""
        self.worker_id = worker_id
        self.mailboxes: dict[str, Mailbox] = {}
        extra = {"front": front_handle} if front_handle is not None else {}
        self.stream = handle.outputs.options(num_returns="streaming").remote(front_id, **extra)
        self.on_close = on_close
        self.task = asyncio.ensure_future(self._run())

    def register(self, request_id: str) -> Mailbox:
        box = self.mailboxes[request_id] = Mailbox()
        return box

    def unregister(self, request_id: str) -> None:
        self.mailboxes.pop(request_id, None)

    async def _run(self) -> None:
        error = None
        try:
            async for ref in self.stream:
                for delta in await ref:
                    box = self.mailboxes.get(delta.request_id)
                    if box is None:
                        continue
                    if delta.info and delta.info.worker_failed:  # as if the worker had died
                        box.put(Gone(self.worker_id, EngineDeadError(delta.info.worker_failed)))
                    else:
                        box.put(delta)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the worker died
            error = e
        finally:
            self.on_close(self)
            for box in self.mailboxes.values():
                box.put(Gone(self.worker_id, error))

    def close(self) -> None:
        ray.cancel(self.stream)
        self.task.cancel()


def join(deltas: list[Delta]) -> Delta:
    """Consecutive deltas of one request as one."""
    if len(deltas) == 1:
        return deltas[0]
    first, last = deltas[0], deltas[-1]
    logprobs = None
    if first.logprobs is not None:
        logprobs = [entry for d in deltas for entry in d.logprobs or []]
    info = None
    for d in deltas:
        info = d.info if info is None else info.then(d.info)
    return Delta(
        first.request_id,
        [t for d in deltas for t in d.token_ids],
        "".join(d.text for d in deltas),
        logprobs,
        last.finish_reason,
        last.stop_reason,
        info,
    )
