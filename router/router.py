"""The Router: the control plane. It knows the worker pools (membership, health, load) and
chooses workers for the fronts; it never carries a token.

A front asks `route(role, key)` for each phase of a request (prefill by prefix affinity,
decode by least load) and drives the request itself; the tokens go from the worker to the
front. So a Router that dies or restarts breaks no stream in flight, and any number of
Router replicas can serve the same fronts: they see the same members (`discover`: the
pools' named worker actors, re-read every health period) and choose by rendezvous hashing,
so they agree on every prefix.

Membership comes from an explicit list (local bring-up), `add_worker` / `remove_worker`,
and `discover()` (Serve: the pool replicas' named actors). A worker that fails its health
check, or reports that it is draining, gets no new request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ray.exceptions import ActorUnavailableError, RayActorError

from kvray.actors.messages import WorkerStats
from kvray.configs import DeploymentConfig
from kvray.engine.request_limits import RequestLimits
from kvray.errors import KvrayError
from kvray.routing import WorkerLoad, choose_decode, choose_prefill
from kvray.timeouts import wait_for

logger = logging.getLogger(__name__)
DEAD = (RayActorError, ActorUnavailableError)
STATS_TIMEOUT_S = 30.0
WORKER_STATS_S = 2.0  # /metrics leaves out a worker that does not report within this
MAX_MISSED_PROBES = 3  # probes in a row without an answer: no more requests until it answers

# worker id -> (role, actor handle) of every live worker the cluster has now
Discover = Callable[[], dict[str, tuple[str, object]]]


class NoWorkerError(KvrayError):
    """No live worker of the needed role is left."""


@dataclass
class _Worker:
    worker_id: str
    role: str
    handle: object
    load: WorkerLoad
    accepting: bool = True
    missed: int = 0  # health probes in a row it did not answer (timeout or error)


class Router:
    def __init__(
        self,
        config: dict,
        workers: list[tuple[str, str, object]] | None = None,
        discover: Discover | None = None,
    ):
        self.config = DeploymentConfig(**config)
        self.discover = discover
        self.workers: dict[str, _Worker] = {}
        for wid, role, handle in workers or []:
            self.add_worker(wid, role, handle)
        self.health_task: asyncio.Task | None = None
        self.refreshing: asyncio.Lock | None = None

    # ---- membership -----------------------------------------------------------------------

    def add_worker(self, worker_id: str, role: str, handle) -> None:
        if worker_id not in self.workers:
            self.workers[worker_id] = _Worker(worker_id, role, handle, WorkerLoad(worker_id))
            logger.info("kvray router: worker %s (%s) joined", worker_id, role)

    def remove_worker(self, worker_id: str, why: str = "leaving") -> None:
        if self.workers.pop(worker_id, None) is not None:
            logger.info("kvray router: worker %s removed (%s)", worker_id, why)

    async def refresh(self) -> None:
        """Re-read the members (when discovering) and every worker's load; drop the dead."""
        self.refreshing = self.refreshing or asyncio.Lock()
        async with self.refreshing:
            if self.discover is not None:
                found = await asyncio.to_thread(self.discover)
                for wid in [w for w in self.workers if w not in found]:
                    self.remove_worker(wid, "gone")
                for wid, (role, handle) in found.items():
                    self.add_worker(wid, role, handle)
            await asyncio.gather(*(self._probe(w) for w in list(self.workers.values())))

    async def _probe(self, w: _Worker) -> None:
        try:
            # shielded: a slow answer still lands (it is only a load report)
            s = await wait_for(asyncio.shield(self._stats(w)), STATS_TIMEOUT_S)
        except DEAD:
            self.remove_worker(w.worker_id, "failed its health check")
        except Exception as e:  # slow or failing, but alive: keep it, stop routing to it
            w.missed += 1
            logger.warning("kvray router: no load report from %s (%d in a row): %r", w.worker_id, w.missed, e)
        else:
            w.missed = 0
            w.load.num_requests, w.load.kv_usage, w.load.routed = s.num_running + s.num_waiting, s.kv_usage, 0
            w.accepting = s.accepting

    async def _stats(self, w: _Worker) -> WorkerStats:
        return await w.handle.stats.remote()

    def start(self) -> None:
        """Start the health loop on the running event loop (idempotent)."""
        if self.health_task is None:
            self.health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # never let the loop die
                logger.exception("kvray router: health check failed")
            await asyncio.sleep(self.config.router.health_check_seconds)

    # ---- the fronts' calls ----------------------------------------------------------------

    async def route(
        self, role: str, key: bytes | None = None, exclude: list[str] | tuple = ()
    ) -> tuple[str, object] | None:
        """(worker id, handle) of the worker of `role` for the next request (`key`: its
        prefix hash, for prefill and mixed), or None when the pool has no live worker now:
        an answer, not an error (a front waiting for a replacement asks again; it alone
        decides when that becomes NoWorkerError)."""
        pool = self._pool(role, exclude)
        if not pool:  # maybe one joined since the last refresh
            await self.refresh()
            pool = self._pool(role, exclude)
        if not pool:
            return None
        loads = [w.load for w in pool]
        if role == "decode":
            chosen = choose_decode(loads)
        else:
            chosen = choose_prefill(loads, key, self.config.router.imbalance_threshold)
        chosen.routed += 1
        worker = self.workers[chosen.worker_id]
        return worker.worker_id, worker.handle

    def _pool(self, role: str, exclude) -> list[_Worker]:
        return [
            w
            for w in self.workers.values()
            if w.role == role and w.accepting and w.missed < MAX_MISSED_PROBES and w.worker_id not in exclude
        ]

    async def model_info(self, wait_seconds: float = 0.0) -> RequestLimits:
        """The limits requests are checked against, as a worker's engine sees them (waiting up to
        `wait_seconds` for a first worker to join)."""
        deadline = time.monotonic() + wait_seconds
        while True:
            for w in list(self.workers.values()):
                try:
                    return await w.handle.model_info.remote()
                except DEAD:
                    self.remove_worker(w.worker_id, "died before answering")
            if time.monotonic() >= deadline:
                raise NoWorkerError("no live worker left")
            await asyncio.sleep(0.5)
            await self.refresh()

    async def live_workers(self) -> dict[str, list[str]]:
        pools: dict[str, list[str]] = {}
        for w in self.workers.values():
            if w.accepting:
                pools.setdefault(w.role, []).append(w.worker_id)
        return {role: sorted(ids) for role, ids in pools.items()}

    async def worker_stats(self) -> list[WorkerStats]:
        """Every live worker's stats (for /metrics); the dead, and those that do not answer
        within WORKER_STATS_S (a hung engine), are left out."""
        stats = await asyncio.gather(
            *(wait_for(self._stats(w), WORKER_STATS_S) for w in self.workers.values()), return_exceptions=True
        )
        return [s for s in stats if isinstance(s, WorkerStats)]
