"""The front: drives each request it owns through its workers and receives its tokens.

An ingress replica (router/app.py) — or, without HTTP, a `FrontActor` (cluster/local.py) —
holds one `Frontend`. For every request it asks the Router (control plane) for a worker
per phase, calls the workers itself (prefill -> first token + KVTicket -> decode; or one
`mixed` worker), and reads the tokens from one long-lived `outputs` stream per worker it
uses (`_Inbox`): the worker sends one list of deltas per engine step for all of this
front's requests, and the inbox hands each delta to its request. No token passes the
Router, so it may die or restart under running streams.

Failures: a worker that dies (or is draining) before the request produced output here is
excluded and the phase is retried on another one (at most `router.max_retries` times); one
that dies mid-stream ends the request with WorkerDiedError. A caller that leaves aborts
the request on every worker it touched, and a prefill whose pin no decode worker took is
released.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

import ray

from kvray.actors.messages import Delta, EngineRequest, PrefillResult
from kvray.actors.worker import WorkerLeavingError
from kvray.configs import DeploymentConfig
from kvray.engine import CompletionOutput, SamplingParams
from kvray.engine.sampling_params import RequestOutputKind
from kvray.errors import KvrayError
from kvray.router.metrics import RequestStats, RequestTimer
from kvray.router.policy import prefix_key
from kvray.router.router import DEAD, NoWorkerError

logger = logging.getLogger(__name__)
ROUTER_WAIT_S = 60.0  # how long a front keeps asking a Router that is (re)starting


class WorkerDiedError(KvrayError):
    """The worker serving a request died after the request had produced output."""


class _Gone:
    """Put in a request's mailbox when its worker's stream ends."""

    def __init__(self, worker_id: str, error: BaseException | None):
        self.worker_id = worker_id
        self.error = error


class _Mailbox:
    """One request's deltas as they arrive; `take` returns all that are there (waiting for
    at least one), so a reader that fell behind catches up in one piece."""

    def __init__(self):
        self.items: list[Delta | _Gone] = []
        self.ready = asyncio.Event()

    def put(self, item: Delta | _Gone) -> None:
        self.items.append(item)
        self.ready.set()

    async def take(self) -> list[Delta | _Gone]:
        await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        return items


class _Inbox:
    """One worker's `outputs` stream into this front, split into per-request mailboxes."""

    def __init__(self, front_id: str, worker_id: str, handle, on_close: Callable[[_Inbox], None]):
        self.worker_id = worker_id
        self.mailboxes: dict[str, _Mailbox] = {}
        self.stream = handle.outputs.options(num_returns="streaming").remote(front_id)
        self.on_close = on_close
        self.task = asyncio.ensure_future(self._run())

    def register(self, request_id: str) -> _Mailbox:
        box = self.mailboxes[request_id] = _Mailbox()
        return box

    def unregister(self, request_id: str) -> None:
        self.mailboxes.pop(request_id, None)

    async def _run(self) -> None:
        error = None
        try:
            async for ref in self.stream:
                for delta in await ref:
                    box = self.mailboxes.get(delta.request_id)
                    if box is not None:
                        box.put(delta)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the worker died
            error = e
        finally:
            self.on_close(self)
            for box in self.mailboxes.values():
                box.put(_Gone(self.worker_id, error))

    def close(self) -> None:
        ray.cancel(self.stream)
        self.task.cancel()


class Frontend:
    def __init__(self, router, config: DeploymentConfig, front_id: str, stats: RequestStats | None = None):
        """`router`: a handle to the Router (a Serve deployment handle or an actor handle:
        `router.route.remote(...)` is awaited either way)."""
        self.router = router
        self.config = config
        self.front_id = front_id
        self.stats = stats or RequestStats()
        self.block_size = config.engine.get("block_size", 16)
        self.inboxes: dict[str, _Inbox] = {}
        self.num_retries = 0

    def close(self) -> None:
        for inbox in list(self.inboxes.values()):
            inbox.close()

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[CompletionOutput]:
        """Run one request (one sample); yields its CompletionOutput, cumulative, after
        every delta (the same object, grown in place: read it before the next one)."""
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        req = EngineRequest(request_id, prompt_token_ids, params, self.front_id)
        timer = RequestTimer(self.stats, len(prompt_token_ids))
        out = CompletionOutput(0, "", [], logprobs=[] if params.logprobs is not None else None)
        key = prefix_key(prompt_token_ids, self.block_size, self.config.router.affinity_blocks)
        touched: dict[str, object] = {}  # worker id -> handle: who must hear of an abort
        unclaimed = None  # a prefill worker whose pin no decode worker has taken yet
        try:
            if self.config.disaggregated:
                prefill, handoff = await self._prefill(req, key, touched)
                unclaimed = prefill
                timer.on_queue_time(handoff.queue_seconds)
                timer.cost_usd += handoff.cost_usd
                role, key = "decode", None

                def start(handle):
                    return handle.decode.remote(req, handoff, prefill)

            else:
                role = "mixed"

                def start(handle):
                    return handle.generate.remote(req)

            async for delta in self._run_on(role, key, req, start, touched):
                unclaimed = None
                _grow(out, delta)
                if delta.info:
                    if not self.config.disaggregated:
                        timer.on_queue_time(delta.info.get("queue_seconds"))
                    timer.cost_usd += delta.info.get("cost_usd", 0.0)
                    if "error" in delta.info:
                        raise RuntimeError(f"{request_id} failed on its worker: {delta.info['error']}")
                timer.on_tokens(len(delta.token_ids))
                yield out
        finally:
            if out.finish_reason is None:  # the caller left, or it failed: stop it everywhere
                for handle in touched.values():
                    handle.abort.remote(request_id)
                if unclaimed is not None:
                    unclaimed.release_kv.remote(request_id)
            self.stats.finish(timer, out.finish_reason or "abort")

    async def _prefill(self, req: EngineRequest, key, touched: dict) -> tuple[object, PrefillResult]:
        tried: list[str] = []
        while True:
            wid, handle = await self._route("prefill", key, tried)
            touched[wid] = handle
            try:
                return handle, await handle.prefill.remote(req)
            except (*DEAD, WorkerLeavingError):
                self._retry(tried, wid)

    async def _run_on(self, role: str, key, req: EngineRequest, start, touched: dict) -> AsyncIterator[Delta]:
        """Start the request on a worker of `role` and yield its deltas until the last."""
        tried: list[str] = []
        while True:
            wid, handle = await self._route(role, key, tried)
            touched[wid] = handle
            inbox = self._inbox(wid, handle)
            box = inbox.register(req.request_id)
            produced = False
            try:
                try:
                    await start(handle)
                except (*DEAD, WorkerLeavingError):
                    self._retry(tried, wid)
                    continue
                gone = None
                while gone is None:
                    items = await box.take()
                    deltas = [d for d in items if not isinstance(d, _Gone)]
                    gone = next((g for g in items if isinstance(g, _Gone)), None)
                    if deltas:
                        produced = True
                        delta = _join(deltas)
                        yield delta
                        if delta.finish_reason is not None:
                            return
                if produced:
                    raise WorkerDiedError(f"{role} worker {wid} died while streaming {req.request_id}")
                self._retry(tried, wid)
            finally:
                inbox.unregister(req.request_id)

    def _retry(self, tried: list[str], worker_id: str) -> None:
        tried.append(worker_id)
        self.num_retries += 1
        if len(tried) > self.config.router.max_retries:
            raise NoWorkerError(f"gave up after {len(tried)} workers failed: {sorted(tried)}")

    async def _route(self, role: str, key, exclude: list[str]) -> tuple[str, object]:
        """Ask the Router; while it is (re)starting, ask again for up to ROUTER_WAIT_S."""
        deadline = time.monotonic() + ROUTER_WAIT_S
        while True:
            try:
                return await self.router.route.remote(role, key, exclude)
            except KvrayError:
                raise
            except Exception as e:
                cause = getattr(e, "cause", None)
                if isinstance(cause, KvrayError):
                    raise cause from None
                if time.monotonic() > deadline:
                    raise
                logger.warning("kvray front: the router did not answer (%r); asking again", e)
                await asyncio.sleep(0.5)

    def _inbox(self, worker_id: str, handle) -> _Inbox:
        inbox = self.inboxes.get(worker_id)
        if inbox is None:
            inbox = self.inboxes[worker_id] = _Inbox(self.front_id, worker_id, handle, self._forget)
        return inbox

    def _forget(self, inbox: _Inbox) -> None:
        if self.inboxes.get(inbox.worker_id) is inbox:
            del self.inboxes[inbox.worker_id]


def _join(deltas: list[Delta]) -> Delta:
    """Consecutive deltas of one request as one."""
    if len(deltas) == 1:
        return deltas[0]
    first, last = deltas[0], deltas[-1]
    logprobs = None
    if first.logprobs is not None:
        logprobs = [entry for d in deltas for entry in d.logprobs or []]
    info: dict = {}
    for d in deltas:
        info.update(d.info or {})
    return Delta(
        first.request_id,
        [t for d in deltas for t in d.token_ids],
        "".join(d.text for d in deltas),
        logprobs,
        last.finish_reason,
        last.stop_reason,
        info or None,
    )


def _grow(out: CompletionOutput, delta: Delta) -> None:
    out.text += delta.text
    out.token_ids.extend(delta.token_ids)
    if out.logprobs is not None and delta.logprobs:
        out.logprobs.extend(delta.logprobs)
    if delta.finish_reason is not None:
        out.finish_reason = delta.finish_reason
        out.stop_reason = delta.stop_reason
