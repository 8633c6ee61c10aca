"""The Router actor: holds the worker pools, picks workers, survives worker deaths.

Disaggregated: prefill worker (prefix affinity) -> first token + KVTicket -> decode worker
(least loaded), which pulls the KV and streams the rest. Colocated: one mixed worker does
both. A worker that dies is removed and traffic continues on the rest; a request whose
worker died before it produced any output is retried on another worker; one whose decode
worker died mid-stream fails with WorkerDiedError (streamed tokens cannot be unsent).

The router remembers which workers each in-flight request touched, so `abort(request_id)`
(a client that went away) reaches every one of them, and a request whose consumer stops
early is aborted on them too. It records the request-level metrics (router/metrics.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from kvray.configs import DeploymentConfig
from kvray.engine import CompletionOutput, RequestOutput, SamplingParams
from kvray.errors import KvrayError
from kvray.router.metrics import RequestTimer, RouterMetrics
from kvray.router.policy import WorkerLoad, choose_decode, choose_prefill, prefix_key

logger = logging.getLogger(__name__)
_DEAD = (RayActorError, ActorUnavailableError)


class WorkerDiedError(KvrayError):
    """The worker serving a request died after the request had produced output."""


class NoWorkerError(KvrayError):
    """No live worker of the needed role is left."""


@dataclass
class _Worker:
    worker_id: str
    role: str
    handle: object
    load: WorkerLoad


class Router:
    def __init__(self, config: dict, workers: list[tuple[str, str, object]], model_name: str | None = None):
        self.config = DeploymentConfig(**config)
        self.workers = {wid: _Worker(wid, role, h, WorkerLoad(wid)) for wid, role, h in workers}
        self.block_size = self.config.engine.get("block_size", 16)
        self.tokenizer = _load_tokenizer(self.config.engine.get("model", "smollm2-135m-instruct"))
        self.ids = itertools.count()
        self.health_task: asyncio.Task | None = None
        self.num_retries = 0
        self.active: dict[str, dict[str, _Worker]] = {}  # request id -> the workers it touched
        self.aborted: set[str] = set()
        self.metrics = RouterMetrics(model_name or self.config.engine.get("model", "smollm2-135m-instruct"))
        self.timers: dict[str, RequestTimer] = {}
        self.workers_changed = asyncio.Event()

    # ---- pool membership (Serve pool replicas join and leave) -----------------------------

    def add_worker(self, worker_id: str, role: str, handle) -> None:
        self.workers[worker_id] = _Worker(worker_id, role, handle, WorkerLoad(worker_id))
        self.workers_changed.set()
        logger.info("kvray router: worker %s (%s) joined", worker_id, role)

    def remove_worker(self, worker_id: str) -> None:
        """Route nothing new to the worker (it is leaving; it drains what it holds)."""
        if self.workers.pop(worker_id, None) is not None:
            logger.info("kvray router: worker %s leaving", worker_id)

    # ---- public API -----------------------------------------------------------------------

    async def generate(
        self, prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request (the last has finished=True)."""
        self._ensure_health_task()
        request_id = request_id or f"req-{next(self.ids)}"
        prompt_input = self._prompt_input(prompt)
        if self.config.disaggregated:
            gen = self._generate_disaggregated(request_id, prompt_input, params)
        else:
            gen = self._generate_colocated(request_id, prompt_input, params)
        timer = self.timers[request_id] = RequestTimer(len(prompt_input["prompt_token_ids"]))
        self.active[request_id] = {}
        final = None
        try:
            async for out in gen:
                self.metrics.on_output(timer, out)
                if out.finished:
                    final = out
                yield out
                if request_id in self.aborted:
                    return
        finally:
            await gen.aclose()
            touched = self.active.pop(request_id, {})
            self.aborted.discard(request_id)
            del self.timers[request_id]
            if final is None:  # the consumer left, or it failed: stop it everywhere
                for w in touched.values():
                    w.handle.abort.remote(request_id)
            reason = final.outputs[0].finish_reason if final is not None else "abort"
            self.metrics.on_finish(timer, reason or "abort")

    async def abort(self, request_id: str) -> bool:
        """Abort an in-flight request on every worker it touched (a client went away).
        Returns False when the request is not (or no longer) in flight."""
        touched = self.active.get(request_id)
        if touched is None:
            return False
        self.aborted.add(request_id)
        await asyncio.gather(
            *(w.handle.abort.remote(request_id) for w in touched.values()), return_exceptions=True
        )
        return True

    async def metrics_text(self) -> bytes:
        """Prometheus text: the router's request metrics and every live worker's stats."""
        stats = await asyncio.gather(
            *(self._read_stats(w) for w in self.workers.values()), return_exceptions=True
        )
        return self.metrics.render([s for s in stats if not isinstance(s, BaseException)])

    async def model_info(self, wait_seconds: float = 0.0) -> dict:
        """max_model_len and vocab_size, as a worker's engine sees them (waiting up to
        `wait_seconds` for a first worker to join)."""
        deadline = time.monotonic() + wait_seconds
        while True:
            for w in list(self.workers.values()):
                try:
                    return await w.handle.model_info.remote()
                except _DEAD:
                    self._remove(w, "died before answering")
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoWorkerError("no live worker left")
            self.workers_changed.clear()
            try:
                await asyncio.wait_for(self.workers_changed.wait(), timeout=left)
            except asyncio.TimeoutError:
                pass

    async def live_workers(self) -> dict[str, list[str]]:
        pools: dict[str, list[str]] = {}
        for w in self.workers.values():
            pools.setdefault(w.role, []).append(w.worker_id)
        return pools

    async def worker_stats(self) -> list:
        return await asyncio.gather(*(self._read_stats(w) for w in self.workers.values()))

    async def check_health(self) -> None:
        """Ping every worker; remove the dead, refresh the others' load."""

        async def probe(w: _Worker):
            try:
                # shielded: a late answer still reaches the metrics (its pulls are drained)
                s = await asyncio.wait_for(asyncio.shield(self._read_stats(w)), timeout=30)
                w.load.kv_usage, w.load.num_running = s.kv_usage, s.num_running
            except _DEAD:
                self._remove(w, "failed its health check")
            except asyncio.TimeoutError:
                pass

        await asyncio.gather(*(probe(w) for w in list(self.workers.values())))

    # ---- request paths --------------------------------------------------------------------

    async def _generate_disaggregated(self, rid, prompt_input, params):
        key = prefix_key(
            prompt_input["prompt_token_ids"], self.block_size, self.config.router.affinity_blocks
        )
        prefill, handoff = await self._with_retries(
            rid,
            "prefill",
            lambda pool: choose_prefill(pool, key, self.config.router.imbalance_threshold),
            lambda w: w.handle.prefill.remote(rid, prompt_input, params),
        )
        if rid in self.aborted:  # the client left during the prefill: let the pin go
            if handoff.ticket is not None:
                prefill.handle.release_kv.remote(rid)
            return
        yield self._first_token_output(rid, params, handoff)  # time to first token ends here
        tried: set[str] = set()
        while True:
            decode = self._pick_for(rid, "decode", choose_decode, tried)
            produced = False
            decode.load.in_flight += 1
            start = self._start_cost(decode)
            try:
                async for ref in decode.handle.decode.remote(rid, params, handoff, prefill.handle):
                    out = await ref
                    produced = True
                    yield out
                return
            except _DEAD as e:
                self._remove(decode, "died while serving a request")
                if produced:
                    raise WorkerDiedError(
                        f"decode worker {decode.worker_id} died while streaming {rid}"
                    ) from e
                tried.add(decode.worker_id)
                self._count_retry(tried)
            finally:
                decode.load.in_flight -= 1
                self._add_cost(rid, decode, start)

    async def _generate_colocated(self, rid, prompt_input, params):
        tried: set[str] = set()
        while True:
            worker = self._pick_for(
                rid, "mixed", lambda pool: min(pool, key=lambda w: (w.in_flight, w.worker_id)), tried
            )
            produced = False
            worker.load.in_flight += 1
            start = self._start_cost(worker)
            try:
                async for ref in worker.handle.generate.remote(rid, prompt_input, params):
                    out = await ref
                    produced = True
                    yield out
                return
            except _DEAD as e:
                self._remove(worker, "died while serving a request")
                if produced:
                    raise WorkerDiedError(f"worker {worker.worker_id} died while streaming {rid}") from e
                tried.add(worker.worker_id)
                self._count_retry(tried)
            finally:
                worker.load.in_flight -= 1
                self._add_cost(rid, worker, start)

    async def _with_retries(self, rid, role, choose, call):
        """Run a unary call on a chosen worker; on death, remove it and try another."""
        tried: set[str] = set()
        while True:
            worker = self._pick_for(rid, role, choose, tried)
            worker.load.in_flight += 1
            start = self._start_cost(worker)
            try:
                return worker, await call(worker)
            except _DEAD:
                self._remove(worker, "died before answering")
                tried.add(worker.worker_id)
                self._count_retry(tried)
            finally:
                worker.load.in_flight -= 1
                self._add_cost(rid, worker, start)

    # ---- helpers --------------------------------------------------------------------------

    async def _read_stats(self, worker: _Worker):
        """A worker's WorkerStats. Every stats() call goes through here: it drains the
        worker's finished KV pull durations, which the metrics observe once each."""
        stats = await worker.handle.stats.remote()
        self.metrics.on_worker_stats(stats)
        return stats

    def _pick(self, role: str, choose, exclude: set[str]) -> _Worker:
        pool = [w for w in self.workers.values() if w.role == role and w.worker_id not in exclude]
        if not pool:
            raise NoWorkerError(f"no live {role} worker left")
        chosen = choose([w.load for w in pool])
        return self.workers[chosen.worker_id]

    def _pick_for(self, rid: str, role: str, choose, exclude: set[str]) -> _Worker:
        worker = self._pick(role, choose, exclude)
        self.active.setdefault(rid, {})[worker.worker_id] = worker
        return worker

    @staticmethod
    def _start_cost(worker: _Worker) -> tuple[float, int]:
        return time.monotonic(), worker.load.in_flight

    def _add_cost(self, rid: str, worker: _Worker, start: tuple[float, int]) -> None:
        """The worker's price x the time this request held it, split by the requests sharing it."""
        timer = self.timers.get(rid)
        price = getattr(self.config, worker.role).price_per_hour
        if timer is not None and price:
            held = time.monotonic() - start[0]
            timer.cost_usd += price / 3600.0 * held / max(start[1], 1)

    def _count_retry(self, tried: set[str]) -> None:
        self.num_retries += 1
        if len(tried) > self.config.router.max_retries:
            raise NoWorkerError(f"gave up after {len(tried)} workers died: {sorted(tried)}")

    def _remove(self, worker: _Worker, why: str) -> None:
        if self.workers.pop(worker.worker_id, None) is not None:
            logger.warning("kvray router: removing worker %s (%s)", worker.worker_id, why)

    def _ensure_health_task(self) -> None:
        if self.health_task is None:
            self.health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.router.health_check_seconds)
            try:
                await self.check_health()
            except Exception:  # never let the loop die
                logger.exception("kvray router: health check failed")

    def _first_token_output(self, rid: str, params: SamplingParams, handoff) -> RequestOutput:
        """The prefill's token, streamed before the decode worker takes over (its later
        cumulative outputs repeat it). Text is held back if the token ends mid-character."""
        text = self.tokenizer.decode([handoff.first_token], skip_special_tokens=params.skip_special_tokens)
        if text.endswith("\ufffd"):
            text = ""
        first = CompletionOutput(index=0, text=text, token_ids=[handoff.first_token])
        return RequestOutput(
            rid,
            handoff.prompt,
            handoff.prompt_token_ids,
            [first],
            finished=False,
            num_cached_tokens=handoff.num_cached_tokens,
            # PrefillResult.metrics, the prefill engine's RequestMetrics (its queue time is
            # the request's); None from a worker that does not send it
            metrics=handoff.metrics,
        )

    def _prompt_input(self, prompt) -> dict:
        if isinstance(prompt, str):
            return {"prompt": prompt, "prompt_token_ids": self.tokenizer(prompt).input_ids}
        if isinstance(prompt, dict):
            return {"prompt": prompt.get("prompt"), "prompt_token_ids": list(prompt["prompt_token_ids"])}
        return {"prompt": None, "prompt_token_ids": list(prompt)}


def _load_tokenizer(model: str):
    from kvray.models.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(model))


RouterActor = ray.remote(Router)
