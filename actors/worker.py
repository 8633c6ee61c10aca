"""Engine workers: one Ray actor per engine, in the role `prefill`, `decode` or `mixed`
(one class each: actors/prefill_worker.py, actors/decode_worker.py, `MixedWorker` here).

What every role shares lives in `EngineWorker`: the engine (an `AsyncLLM`, the only view
of it a worker has), the shard group of a tp x pp > 1 worker, the outbox that streams
deltas to the fronts, draining, health, stats and load signals.

Tokens never travel as one call or object per token: `decode` and `generate` return once
the engine has accepted the request, and the request's deltas go to the front that owns
it (`EngineRequest.destination`) on that front's `outputs` stream, one list per engine
step for all of the front's requests here (actors/outbox.py).

The worker is an async actor: engine steps run on the AsyncLLM's own thread, so the
actor's event loop stays free for pulls, aborts and health checks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Literal

import ray
import torch
from ray.exceptions import ActorDiedError

from kvray.actors.messages import TRANSFER_BUCKETS, Delta, EngineRequest, WorkerStats
from kvray.actors.net import bind_collectives_to, node_ip
from kvray.actors.outbox import Outbox
from kvray.actors.shard_group import start_shards
from kvray.actors.signals import LoadSignals
from kvray.configs import KVTransferConfig
from kvray.engine import AsyncLLM, EngineConfig, RequestOutput, SamplingParams
from kvray.engine.engine_stats import EngineStats
from kvray.engine.request_limits import RequestLimits
from kvray.errors import EngineDeadError, KvrayError
from kvray.timeouts import wait_for
from kvray.tracing import Tracing, traces_endpoint

logger = logging.getLogger(__name__)
Role = Literal["prefill", "decode", "mixed"]
ABORT_MEMORY_S = 300.0  # how long a worker refuses a request whose abort came first
FRONT_CHECK_S = 2.0  # how often a worker asks whether a front it streams to still lives


class RequestAbortedError(KvrayError):
    """The request's abort reached this worker before the request did (an async actor
    does not keep one caller's order): it is refused, so it cannot run with nobody to read it."""


class WorkerLeavingError(KvrayError):
    """The worker is draining before it stops: send the request to another one."""


class EngineWorker:
    role: Role

    def __init__(
        self,
        worker_id: str,
        engine_config: dict,
        kv_config: dict | None = None,
        torch_threads: int | None = None,
        shard_resources: dict | None = None,
        price_per_hour: float = 0.0,
        otlp_traces_endpoint: str | None = None,
    ):
        """`shard_resources` ({"num_cpus", "num_gpus"}): what each of the other shards of a
        tp x pp > 1 worker reserves; they start in this actor's placement group.
        `price_per_hour` (USD): what a request costs is this times its share of the steps.
        `otlp_traces_endpoint`: where traced requests' spans go (kvray/tracing.py)."""
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.worker_id = worker_id
        endpoint = traces_endpoint(otlp_traces_endpoint)
        self.tracing = Tracing(endpoint, self.role) if endpoint else None
        self.span_attributes = {"kvray.worker_id": worker_id, "kvray.role": self.role}
        self.kv_config = KVTransferConfig(**(kv_config or {}))
        # the hand-off's timing rules this worker applies (lease, hold, the pin's end)
        self.lease = self.kv_config.lease_policy()
        config = EngineConfig(**engine_config)
        self.host = node_ip()
        bind_collectives_to(self.host)  # KV pairs and shard groups: never loopback by accident
        self.shards: list = []  # ranks 1.. of this worker's group
        shard = None
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            self.shards, shard, self.group_store = start_shards(
                worker_id,
                engine_config,
                self.kv_config.model_dump(),
                shard_resources or {},
                torch_threads,
                self.host,
            )
        # An engine that can no longer serve (a failed step, a broken loop, a hung step)
        # stops this worker taking requests; its requests are failed over (their fronts
        # move them) and `ready` fails, so Serve replaces the worker. A shard group's
        # collectives are then out of step: it exits instead (crash-only), and the router,
        # Serve and its shards all see it gone.
        self.llm = AsyncLLM(config, on_failure=self._engine_failed, shard=shard, lease=self.lease)
        self.price_per_hour = price_per_hour
        self.outbox: Outbox | None = None  # made on the actor's loop, at first use
        self.accepting = True
        self.aborted: dict[str, float] = {}  # request id -> when its abort came (oldest first)
        self.tasks: set[asyncio.Task] = set()  # held: a task nobody references may be collected

    def _start(self, coro) -> None:
        """Run `coro` on the actor's loop to its end, unawaited (its task held until then)."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _engine_failed(self, error: BaseException) -> None:  # any thread
        self.accepting = False
        if self.shards:
            _exit_group(error)

    async def ready(self) -> str:
        """Health: this actor and every shard of its group are alive, and its engine can
        serve (raises EngineDeadError when not: its loop died, or a step hangs)."""
        self.llm.check_health()
        await asyncio.gather(*(shard.ready.remote() for shard in self.shards))
        return self.worker_id

    async def drain(self) -> None:
        """Take no new request (they get WorkerLeavingError); finish the ones held."""
        self.accepting = False

    def _check_accepting(self, request_id: str) -> None:
        if not self.accepting:
            why = "unhealthy" if self.llm.error is not None else "draining"
            raise WorkerLeavingError(f"worker {self.worker_id} is {why}")
        if request_id in self.aborted:
            logger.warning("kvray worker %s: %s came after its abort; refused", self.worker_id, request_id)
            raise RequestAbortedError(f"request {request_id} was aborted before it reached {self.worker_id}")

    # ---- the token path -----------------------------------------------------------------

    async def outputs(self, destination: str, front=None) -> AsyncIterator[list[Delta]]:
        """The stream of every delta for the front `destination`, one list per step.
        Call with `.options(num_returns="streaming")`; the front cancels it when it goes,
        and the requests it still had here are aborted. `front`: the front's actor handle:
        a front that dies cancels nothing (Ray does not end a stream whose reader died), so
        the worker asks it every FRONT_CHECK_S whether it lives, and ends the stream when
        it does not."""
        outbox = self._outbox()
        watch = asyncio.ensure_future(_until_dead(front, outbox, destination)) if front is not None else None
        try:
            async for batch in outbox.stream(destination):
                yield batch
        finally:
            if watch is not None:
                watch.cancel()
            for rid in outbox.close(destination):
                await self.abort(rid)

    def _outbox(self) -> Outbox:
        if self.outbox is None:
            loop = asyncio.get_running_loop()
            self.outbox = Outbox(loop, self.price_per_hour, self.tracing, self.span_attributes)
        return self.outbox

    def _admit(self, req: EngineRequest, prefilled: bool = False) -> Outbox:
        self._check_accepting(req.request_id)
        outbox = self._outbox()
        outbox.register(req.request_id, req.destination, req.trace, prefilled)
        return outbox

    async def generate(self, req: EngineRequest) -> None:
        """Run a whole request here (colocated, or one moved here mid-stream from a
        worker that died: its prompt and the tokens it had are recomputed here); returns
        once it is accepted."""
        outbox = self._admit(req)
        try:
            await self.llm.add_request(
                req.request_id,
                {"prompt_token_ids": req.prompt_token_ids},
                req.params,
                req.priority,
                sink=outbox,
                generated_token_ids=req.generated_token_ids,
            )
        except BaseException:
            outbox.unregister(req.request_id)
            raise

    async def abort(self, request_id: str) -> None:
        """Stop the request here and free its blocks. Ray may run this before the call
        that brings the request (async actors reorder one caller's calls): the id is
        remembered for ABORT_MEMORY_S, and the request is refused if it comes later."""
        now = time.monotonic()
        self.aborted.pop(request_id, None)  # re-inserted last: the dict stays oldest first
        self.aborted[request_id] = now
        while now - next(iter(self.aborted.values())) > ABORT_MEMORY_S:
            del self.aborted[next(iter(self.aborted))]
        await self._abort(request_id)

    async def _abort(self, request_id: str) -> None:
        self.llm.abort(request_id)

    # ---- reports ------------------------------------------------------------------------

    async def kv_cache_stats(self):
        return await self.llm.kv_cache_stats()

    async def load_signals(self) -> LoadSignals:
        """Autoscaling signals (actors/signals.py): queues now, latencies lately."""
        return LoadSignals.of(await self.llm.stats(), self._ttft_mean(), self._outbox().itl.mean())

    def _ttft_mean(self) -> float:
        return self._outbox().ttft.mean()

    async def model_info(self) -> RequestLimits:
        """What a front checks requests against before sending them here."""
        return self.llm.limits

    async def _transfer(self) -> tuple[int, float, list[int]]:
        """KV bytes moved, seconds pulling, pulls per duration bucket (roles that move KV)."""
        return 0, 0.0, [0] * (len(TRANSFER_BUCKETS) + 1)

    async def stats(self) -> WorkerStats:
        moved, seconds, buckets = await self._transfer()
        try:
            e: EngineStats = await self.llm.stats()
        except EngineDeadError:  # it holds nothing that counts: say it takes nothing
            return WorkerStats(
                self.worker_id, self.role, 0, 0, 0.0, 0, 0, moved, seconds, buckets, accepting=False
            )
        return WorkerStats(
            worker_id=self.worker_id,
            role=self.role,
            num_running=e.num_running,
            num_waiting=e.num_waiting,
            kv_usage=e.kv.usage,
            used_blocks=e.kv.used_blocks,
            pinned=e.num_pinned,
            kv_transfer_bytes=moved,
            kv_transfer_seconds=seconds,
            kv_pull_buckets=buckets,
            kv_recomputes=e.num_kv_recomputes,
            prefix_queries=e.prefix_queries,
            prefix_hits=e.prefix_hits,
            num_preemptions=e.num_preemptions,
            spec_decode=e.spec_decode,
            accepting=self.accepting,
        )

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)  # its loop releases the shards' serve loops
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # export what is buffered
        for shard in self.shards:
            ray.kill(shard)
        self.shards = []


class MixedWorker(EngineWorker):
    """Both phases in one engine (colocated): nothing moves between workers."""

    role: Role = "mixed"

    async def generate_batch(
        self, request_ids: list[str], prompts: list, params: list[SamplingParams], priorities: list[int]
    ) -> list[RequestOutput]:
        """The offline API's batch: every prompt validated before any is queued; the final
        output of each, in order."""
        await self.llm.validate(prompts, params)
        streams = [
            await self.llm.add_request(rid, prompt, p, priority=prio)
            for rid, prompt, p, prio in zip(request_ids, prompts, params, priorities)
        ]

        async def final(stream) -> RequestOutput:
            out = None
            try:
                async for out in stream:  # noqa: B007 (keep the last)
                    pass
            finally:
                if not stream.finished:  # the caller went away: abort and free the blocks
                    self.llm.abort(stream.request_id)
            return out

        return list(await asyncio.gather(*(final(s) for s in streams)))


async def _until_dead(front, outbox: Outbox, destination: str) -> None:
    """Return once the front's actor is dead, ending its stream (its requests are then
    aborted); a front that is only slow to answer is asked again."""
    while True:
        await asyncio.sleep(FRONT_CHECK_S)
        try:
            await wait_for(front.__ray_ready__.remote(), FRONT_CHECK_S * 5)
        except ActorDiedError:  # (not ActorUnavailableError: unreachable for now, maybe restarting)
            logger.warning("kvray worker: front %s is gone; aborting its requests here", destination)
            outbox.end(destination)
            return
        except Exception:  # noqa: BLE001 (slow, or restarting: ask again)
            continue


def _exit_group(error: BaseException) -> None:
    logger.error("kvray worker: a sharded step failed (%r); exiting so the group is replaced", error)
    os._exit(1)
