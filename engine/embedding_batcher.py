"""Embeddings for concurrent callers, batched: each call's inputs join one queue, and one
thread takes everything queued (up to `max_batch_inputs` inputs) into one `Embedder.embed`
call, which packs it into forward passes. Requests that arrive while a batch runs wait for
the next one together, so a burst of small requests costs a few forward passes, not one
each. A caller that leaves (its task cancelled) is dropped before its batch starts.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass

import torch

from kvray.engine.embedder import Embedder

MAX_BATCH_INPUTS = 256  # inputs one batch takes (Embedder.embed splits it into forward passes)


@dataclass
class _Job:
    token_ids: list[list[int]]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    @property
    def tokens(self) -> int:
        return sum(map(len, self.token_ids))


def _hand_back(job: _Job, result: torch.Tensor | None, error: BaseException | None = None) -> None:
    """Settle the job's future on its caller's loop (from the batcher's thread); a loop
    that has closed meanwhile has no caller left to tell."""
    try:
        job.loop.call_soon_threadsafe(_settle, job.future, result, error)
    except RuntimeError:
        pass


def _settle(future: asyncio.Future, result: torch.Tensor | None, error: BaseException | None) -> None:
    if future.done():  # the caller left
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class EmbeddingBatcher:
    def __init__(self, embedder: Embedder, max_batch_inputs: int = MAX_BATCH_INPUTS):
        self.embedder = embedder
        self.max_batch_inputs = max_batch_inputs
        self.queued_tokens = 0  # tokens of the inputs waiting for a batch (autoscaling's signal)
        self.batches = 0  # batches run so far
        self._queue: deque[_Job] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvray-embed", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """[len(token_ids), dimensions] fp32 embeddings, in order."""
        loop = asyncio.get_running_loop()
        job = _Job(token_ids, loop.create_future(), loop)
        with self._wake:
            if self._closed:
                raise RuntimeError("the embedding batcher is closed")
            self._queue.append(job)
            self.queued_tokens += job.tokens
            self._wake.notify()
        return await job.future

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
        while self._queue:  # never taken: their callers get an error, not a wait forever
            job = self._queue.popleft()
            _hand_back(job, None, RuntimeError("the embedding batcher closed"))

    def _take(self) -> list[_Job] | None:
        """The next batch's jobs (at least one, whatever its size), or None once closed."""
        with self._wake:
            while not self._queue and not self._closed:
                self._wake.wait()
            if self._closed:
                return None
            jobs, inputs = [], 0
            while self._queue and (
                not jobs or inputs + len(self._queue[0].token_ids) <= self.max_batch_inputs
            ):
                job = self._queue.popleft()
                self.queued_tokens -= job.tokens
                if not job.future.done():  # (cancelled: its caller left)
                    jobs.append(job)
                    inputs += len(job.token_ids)
            return jobs

    def _run(self) -> None:
        while (jobs := self._take()) is not None:
            if not jobs:
                continue
            self.batches += 1
            try:
                vectors = self.embedder.embed([ids for job in jobs for ids in job.token_ids])
            except Exception as e:  # noqa: BLE001 (each caller of the batch gets the error)
                for job in jobs:
                    _hand_back(job, None, e)
                continue
            start = 0
            for job in jobs:
                end = start + len(job.token_ids)
                _hand_back(job, vectors[start:end])
                start = end
