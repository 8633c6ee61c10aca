"""The front: drives each request it owns through its workers and receives its tokens.

An ingress replica (router/app.py) — or, without HTTP, a `FrontActor` (cluster/local.py) —
holds one `Frontend`. For every request it asks the Router (control plane) for a worker
per phase, calls the workers itself (prefill -> first token + KVTicket -> decode; or one
`mixed` worker), and reads the tokens from one long-lived `outputs` stream per worker it
uses (`Inbox`, router/inbox.py): the worker sends one list of deltas per engine step for all of this
front's requests, and the inbox hands each delta to its request. No token passes the
Router, so it may die or restart under running streams.

`Frontend.stream` yields each request's deltas as they come: the ingress builds its chunks
from them (router/generation.py). The front keeps only the token ids so far (a migrating
request brings them along) and whether it finished. `Frontend.generate` folds the deltas
into one cumulative `CompletionOutput`, for the Python front (cluster/local.py).

Failures: a worker that dies (or is draining) before the request produced output here is
excluded and the phase is retried on another one (at most `router.max_retries` times). A
request whose worker dies mid-stream *migrates*: it goes to another live worker of the
pool (`generate` with the tokens streamed so far, which that worker recomputes with the
prompt) and the stream goes on from the next token, at most `router.migration_limit`
times; past that it ends with WorkerDiedError. A caller that leaves aborts
the request on every worker it touched, and a prefill whose pin no decode worker took is
released.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from kvray.actors.messages import Delta, EngineRequest, PrefillResult
from kvray.actors.worker import WorkerLeavingError
from kvray.configs import DeploymentConfig
from kvray.engine import CompletionOutput, SamplingParams
from kvray.engine.sampling_params import RequestOutputKind
from kvray.errors import EngineDeadError, KvrayError, RequestFailedError
from kvray.router.inbox import Gone, Inbox, join
from kvray.router.metrics import RequestStats, RequestTimer
from kvray.router.router import DEAD, NoWorkerError
from kvray.routing import prefix_key
from kvray.timeouts import wait_for
from kvray.tracing import RequestTrace, Tracing

logger = logging.getLogger(__name__)
ROUTER_WAIT_S = 60.0  # how long a front keeps asking a Router that is (re)starting
ROUTER_CALL_S = 10.0  # a Router that does not answer one call this soon is asked again
WORKER_POLL_S = 0.5  # how often a request waiting for a worker to join asks again
# a worker that cannot take the request (dead, leaving, or its engine failed): try another
RETRYABLE = (*DEAD, WorkerLeavingError, EngineDeadError)


class RequestTimeoutError(KvrayError):
    """The request passed its deadline (`router.request_timeout_s` or its own) before it
    produced any output; it has been aborted on every worker."""


class WorkerDiedError(KvrayError):
    """The worker serving a request died after the request had produced output (and the
    request could not move to another one)."""

    def __init__(self, message: str, worker_id: str = ""):
        super().__init__(message)
        self.worker_id = worker_id

    def __reduce__(self):  # crosses process boundaries (Ray) with its fields intact
        return type(self), (str(self), self.worker_id)


class Frontend:
    def __init__(
        self,
        router,
        config: DeploymentConfig,
        front_id: str,
        stats: RequestStats | None = None,
        handle=None,
        tracing: Tracing | None = None,
    ):
        """`router`: a handle to the Router (a Serve deployment handle or an actor handle:
        `router.route.remote(...)` is awaited either way). `handle`: the actor this front
        runs in (the workers watch it, and abort its requests should it die). `tracing`:
        this process's tracer (None: off)."""
        self.router = router
        self.tracing = tracing
        self.handle = handle
        self.config = config
        self.front_id = front_id
        self.stats = stats or RequestStats()
        self.block_size = config.engine_config().block_size
        self.inboxes: dict[str, Inbox] = {}
        self.num_retries = 0
        # requests now waiting for a worker to join their pool: role -> summed signal -> value
        self.waiting: dict[str, dict[str, float]] = {}

    @property
    def num_waiting(self) -> int:
        return int(sum(w["running_requests"] for w in self.waiting.values()))

    def _wait(self, role: str, num_tokens: int, sign: int) -> None:
        w = self.waiting.setdefault(role, {"running_requests": 0.0, "queued_prompt_tokens": 0.0})
        w["running_requests"] += sign
        w["queued_prompt_tokens"] += sign * num_tokens

    def close(self) -> None:
        for inbox in list(self.inboxes.values()):
            inbox.close()

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *rest, **options
    ) -> AsyncIterator[CompletionOutput]:
        """`stream` (the same arguments), folded: yields the request's CompletionOutput,
        cumulative, after every delta (the same object, grown in place: read it before the
        next one)."""
        out = new_output(params)
        async with aclosing(self.stream(request_id, prompt_token_ids, params, *rest, **options)) as deltas:
            async for delta in deltas:
                grow(out, delta)
                yield out

    async def stream(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        timeout_s: float | None = None,
        priority: int = 0,
        trace: RequestTrace | None = None,
    ) -> AsyncIterator[Delta]:
        """Run one request (one sample); yields its deltas as they come (what is new since
        the last; the last with its finish reason; a migration goes on from the next token).

        Past its deadline (`timeout_s`, default `router.request_timeout_s`) the request is
        aborted everywhere: RequestTimeoutError if it had no output yet, else its stream
        ends with a delta of finish_reason "abort" (and nothing new). While its pool has
        no live worker it waits for one to join, until the deadline (then NoWorkerError).
        `trace`: the request's trace (each worker chosen is a `route` span)."""
        deadline = time.monotonic() + (timeout_s or self.config.router.request_timeout_s)
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        carrier = trace.carrier if trace is not None else None
        req = EngineRequest(
            request_id, prompt_token_ids, params, self.front_id, priority=priority, trace=carrier
        )
        timer = RequestTimer(self.stats, len(prompt_token_ids), trace=trace)
        generated: list[int] = []  # the token ids so far: a migrating request brings them
        finish_reason = None
        key = prefix_key(prompt_token_ids, self.block_size, self.config.router.affinity_blocks)
        touched: dict[str, object] = {}  # worker id -> handle: who must hear of an abort
        unclaimed = None  # a prefill worker whose pin no decode worker has taken yet
        # a short prompt in PD is prefilled where it decodes (router.max_local_prefill_length)
        handed_off = self.config.disaggregated and (
            len(prompt_token_ids) > self.config.router.max_local_prefill_length
        )
        try:
            if handed_off:
                prefill, handoff = await self._prefill(req, key, touched, deadline)
                unclaimed = prefill
                timer.on_queue_time(handoff.queue_seconds)
                timer.cost_usd += handoff.cost_usd
                role, key = "decode", None
                to_compute = 0  # its KV is pulled, not computed there

                def start(handle):
                    return handle.decode.remote(req, handoff, prefill)

            else:  # the whole request on one worker: colocated, or a short prompt in PD
                role, key = ("decode", None) if self.config.disaggregated else ("mixed", key)
                to_compute = len(prompt_token_ids)
                if self.config.disaggregated:
                    self.stats.count("local_prefills")

                def start(handle):
                    return handle.generate.remote(req)

            migrations, exclude = 0, []
            while finish_reason is None:
                try:
                    deltas = self._run_on(role, key, req, start, touched, exclude, deadline, to_compute)
                    async for delta in deltas:
                        unclaimed = None
                        generated.extend(delta.token_ids)
                        finish_reason = delta.finish_reason
                        self._take(delta, timer, handed_off)
                        yield delta
                except RequestTimeoutError:
                    if not generated:
                        raise
                    finish_reason = "abort"  # mid-stream: the stream ends, as aborted
                    for handle in touched.values():
                        handle.abort.remote(request_id)
                    yield Delta(request_id, [], "", None, finish_reason, None)
                except WorkerDiedError as e:
                    limit = self.config.router.migration_limit
                    if migrations >= limit:
                        raise WorkerDiedError(
                            f"{e} (it had moved {migrations} times: router.migration_limit is {limit})",
                            e.worker_id,
                        ) from None
                    migrations += 1
                    self.stats.count("request_migrations")
                    logger.warning("kvray front: %s; moving it to another worker", e)
                    # the new worker recomputes prompt + tokens so far; in PD a decode worker
                    role = "decode" if self.config.disaggregated else "mixed"
                    key = None if self.config.disaggregated else key
                    exclude = [e.worker_id]
                    moved = dataclasses.replace(req, generated_token_ids=list(generated))
                    to_compute = len(moved.prompt_token_ids) + len(moved.generated_token_ids)

                    def start(handle, moved=moved):
                        return handle.generate.remote(moved)
        finally:
            if finish_reason is None:  # the caller left, or it failed: stop it everywhere
                for handle in touched.values():
                    handle.abort.remote(request_id)
                if unclaimed is not None:
                    unclaimed.release_kv.remote(request_id)
            self.stats.finish(timer, finish_reason or "abort")

    def _take(self, delta: Delta, timer: RequestTimer, handed_off: bool) -> None:
        if delta.info is not None:
            if not handed_off:  # (a hand-off's queue time is the prefill worker's, taken above)
                timer.on_queue_time(delta.info.queue_seconds)
            timer.cost_usd += delta.info.cost_usd
        timer.on_tokens(len(delta.token_ids))
        if delta.finish_reason == "error":
            raise RequestFailedError(
                f"request {delta.request_id} failed on its worker (the cause is in its log)"
            )

    async def _prefill(
        self, req: EngineRequest, key, touched: dict, deadline: float
    ) -> tuple[object, PrefillResult]:
        num_tokens = len(req.prompt_token_ids)
        attempts = self._attempts("prefill", key, [], touched, deadline, num_tokens, req.trace)
        async with aclosing(attempts) as workers:
            async for _, handle in workers:
                try:
                    return handle, await _until(handle.prefill.remote(req), deadline, req.request_id)
                except RETRYABLE:
                    continue
        raise AssertionError("unreachable: _attempts ends by raising")

    async def _run_on(
        self,
        role: str,
        key,
        req: EngineRequest,
        start,
        touched: dict,
        exclude: list[str],
        deadline: float,
        to_compute: int,
    ) -> AsyncIterator[Delta]:
        """Start the request on a worker of `role` (not one of `exclude`) and yield its
        deltas until the last. `to_compute`: the tokens the worker computes for it before
        its next token (counted while it waits for a worker to join the pool). A worker
        that fails before its first delta is retried elsewhere; one that dies after it is
        a WorkerDiedError (the caller migrates the request)."""
        attempts = self._attempts(role, key, list(exclude), touched, deadline, to_compute, req.trace)
        async with aclosing(attempts) as workers:
            async for wid, handle in workers:
                inbox = self._inbox(wid, handle)
                box = inbox.register(req.request_id)
                produced = False
                try:
                    try:
                        await _until(start(handle), deadline, req.request_id)
                    except RETRYABLE:
                        continue
                    gone = None
                    while gone is None:
                        items = await _until(box.take(), deadline, req.request_id)
                        deltas = [d for d in items if not isinstance(d, Gone)]
                        gone = next((g for g in items if isinstance(g, Gone)), None)
                        if deltas:
                            produced = True
                            delta = join(deltas)
                            yield delta
                            if delta.finish_reason is not None:
                                return
                    if produced:
                        raise WorkerDiedError(
                            f"{role} worker {wid} died while streaming {req.request_id}", wid
                        )
                finally:
                    inbox.unregister(req.request_id)

    async def _attempts(
        self,
        role: str,
        key,
        tried: list[str],
        touched: dict,
        deadline: float,
        num_tokens: int,
        trace: dict | None = None,
    ) -> AsyncIterator[tuple[str, object]]:
        """The front's one retry rule: workers of `role` to try in turn, each one the
        Router picks among those not `tried` (and recorded in `touched`, who must hear of
        an abort). Asking for the next means the last one failed before it served the
        request (it refused, died or vanished); after router.max_retries failures,
        NoWorkerError. Each choice is a `route` span of the request's `trace`."""
        while True:
            start = time.time_ns()
            wid, handle = await self._route(role, key, tried, deadline, num_tokens)
            if trace is not None and self.tracing is not None:
                attributes = {"kvray.role": role, "kvray.worker_id": wid, "kvray.retry": len(tried)}
                self.tracing.record("route", trace, start, time.time_ns(), attributes)
            touched[wid] = handle
            yield wid, handle
            tried.append(wid)
            self.num_retries += 1
            if len(tried) > self.config.router.max_retries:
                raise NoWorkerError(f"gave up after {len(tried)} workers failed: {sorted(tried)}")

    async def _route(
        self, role: str, key, exclude: list[str], deadline: float, num_tokens: int
    ) -> tuple[str, object]:
        """Ask the Router. While it is (re)starting, ask again for up to ROUTER_WAIT_S;
        while the pool has no live worker (one died and Serve is replacing it), wait for
        one to join until the request's deadline (counted in `waiting` meanwhile, with its
        `num_tokens` to compute: the pool's autoscaling signals count them)."""
        router_deadline = time.monotonic() + ROUTER_WAIT_S
        waiting = False
        try:
            while True:
                try:
                    return await self._ask_router(role, key, exclude, router_deadline)
                except NoWorkerError as e:
                    if time.monotonic() + WORKER_POLL_S > deadline:
                        raise NoWorkerError(f"{e}; none joined before the request's deadline") from None
                    if not waiting:
                        waiting = True
                        self._wait(role, num_tokens, +1)
                        logger.warning("kvray front: %s; waiting for one to join", e)
                await asyncio.sleep(WORKER_POLL_S)
        finally:
            if waiting:
                self._wait(role, num_tokens, -1)

    async def _ask_router(self, role: str, key, exclude: list[str], router_deadline: float):
        while True:
            try:
                chosen = await wait_for(self.router.route.remote(role, key, exclude), ROUTER_CALL_S)
            except Exception as e:
                cause = getattr(e, "cause", None)  # a Ray task error: the Router's own
                if isinstance(cause, KvrayError):
                    raise cause from None
                if isinstance(e, KvrayError):
                    raise
                if time.monotonic() > router_deadline:
                    raise NoWorkerError(
                        f"the router did not answer for {ROUTER_WAIT_S:g} s ({e!r})"
                    ) from None
                logger.warning("kvray front: the router did not answer (%r); asking again", e)
                await asyncio.sleep(0.5)
                continue
            if chosen is None:  # the Router's way of saying the pool has no live worker now
                raise NoWorkerError(f"no live {role} worker left")
            return chosen

    def _inbox(self, worker_id: str, handle) -> Inbox:
        inbox = self.inboxes.get(worker_id)
        if inbox is None:
            inbox = self.inboxes[worker_id] = Inbox(
                self.front_id, worker_id, handle, self._forget, self.handle
            )
        return inbox

    def _forget(self, inbox: Inbox) -> None:
        if self.inboxes.get(inbox.worker_id) is inbox:
            del self.inboxes[inbox.worker_id]


async def _until(awaitable, deadline: float, request_id: str):
    """Await it, or raise RequestTimeoutError once the request's deadline has passed."""
    try:
        return await wait_for(awaitable, max(deadline - time.monotonic(), 0.0))
    except TimeoutError:
        raise RequestTimeoutError(f"request {request_id} passed its deadline") from None


def new_output(params: SamplingParams) -> CompletionOutput:
    """An empty cumulative output for `grow` (with a logprobs list when they are asked for)."""
    return CompletionOutput(0, "", [], logprobs=[] if params.logprobs is not None else None)


def grow(out: CompletionOutput, delta: Delta) -> None:
    """Append one delta of the request to its cumulative output."""
    out.text += delta.text
    out.token_ids.extend(delta.token_ids)
    if out.logprobs is not None and delta.logprobs:
        out.logprobs.extend(delta.logprobs)
    if delta.finish_reason is not None:
        out.finish_reason = delta.finish_reason
        out.stop_reason = delta.stop_reason
