"""Engine workers: one Ray actor per engine, in the role `prefill`, `decode` or `mixed`.

* prefill: runs the prompt (chunked, prefix-cached), samples the first token and returns
  it with a KVTicket (`prefill`, a unary call); the prompt's blocks stay pinned until the
  decode side confirms its pull (`release_kv`) or the lease ends.
* decode: takes (request, first token, ticket) (`decode`), reserves blocks, pulls the KV
  through its connector, and continues the request in its continuous batch. A failed pull
  recomputes the prompt here (counted in `kv_recomputes`).
* mixed: both phases in one engine (`generate`), nothing moves (colocated mode).

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

from kvray.actors.connectors import CONNECTORS, KVSource
from kvray.actors.kv_pull import KVPuller
from kvray.actors.messages import Delta, EngineRequest, PrefillResult, WorkerStats
from kvray.actors.outbox import Outbox
from kvray.actors.shard_group import node_ip, start_shards
from kvray.actors.signals import RecentMean, engine_load
from kvray.configs import KVTransferConfig
from kvray.engine import AsyncLLM, EngineConfig, RequestOutput, SamplingParams
from kvray.engine.kv_transfer import prefill_params
from kvray.errors import KvrayError

logger = logging.getLogger(__name__)
Role = Literal["prefill", "decode", "mixed"]


class WorkerLeavingError(KvrayError):
    """The worker is draining before it stops: send the request to another one."""


class EngineWorker:
    def __init__(
        self,
        worker_id: str,
        role: Role,
        engine_config: dict,
        kv_config: dict | None = None,
        torch_threads: int | None = None,
        shard_resources: dict | None = None,
        price_per_hour: float = 0.0,
    ):
        """`shard_resources` ({"num_cpus", "num_gpus"}): what each of the other shards of a
        tp x pp > 1 worker reserves; they start in this actor's placement group.
        `price_per_hour` (USD): what a request costs is this times its share of the steps."""
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.worker_id = worker_id
        self.role = role
        self.kv_config = KVTransferConfig(**(kv_config or {}))
        config = EngineConfig(**engine_config)
        host = node_ip()
        self.shards: list = []  # ranks 1.. of this worker's group
        shard = None
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            self.shards, shard, self.group_store = start_shards(
                worker_id,
                engine_config,
                self.kv_config.model_dump(),
                shard_resources or {},
                torch_threads,
                host,
            )
        # A shard group whose step failed has its collectives out of step: the worker
        # exits, so the router, Serve and its shards all see it gone (crash-only).
        self.llm = AsyncLLM(config, on_step_error=_exit_group if self.shards else None, shard=shard)
        engine = self.llm.engine
        self.source = KVSource(engine.pins, engine.runner.kv_cache, engine.device, engine.kv_layout)
        backend = "nccl" if engine.device.type == "cuda" else "gloo"
        connector = CONNECTORS[self.kv_config.connector](worker_id, self.kv_config, host, backend)
        self.connector = connector
        self.puller = KVPuller(connector, self.kv_config, engine.kv_layout, self.shards)
        self.price_per_hour = price_per_hour
        self.outbox: Outbox | None = None  # made on the actor's loop, at first use
        self.accepting = True
        self.pulling: dict[str, bool] = {}  # request id -> abort once its pull is done
        self.holds: dict[str, asyncio.TimerHandle] = {}  # prefill: pins held for sharded pulls
        self.ttft = RecentMean()  # prefill: seconds from arrival here to the first token

    async def ready(self) -> str:
        """Health: this actor and every shard of its group are alive."""
        await asyncio.gather(*(shard.ready.remote() for shard in self.shards))
        return self.worker_id

    async def drain(self) -> None:
        """Take no new request (they get WorkerLeavingError); finish the ones held."""
        self.accepting = False

    # ---- the token path -----------------------------------------------------------------

    async def outputs(self, destination: str) -> AsyncIterator[list[Delta]]:
        """The stream of every delta for the front `destination`, one list per step.
        Call with `.options(num_returns="streaming")`; the front cancels it when it goes,
        and the requests it still had here are aborted."""
        outbox = self._outbox()
        try:
            async for batch in outbox.stream(destination):
                yield batch
        finally:
            for rid in outbox.close(destination):
                await self.abort(rid)

    def _outbox(self) -> Outbox:
        if self.outbox is None:
            self.outbox = Outbox(asyncio.get_running_loop(), self.price_per_hour)
        return self.outbox

    def _admit(self, req: EngineRequest) -> Outbox:
        if not self.accepting:
            raise WorkerLeavingError(f"worker {self.worker_id} is draining")
        outbox = self._outbox()
        outbox.register(req.request_id, req.destination)
        return outbox

    # ---- prefill role -------------------------------------------------------------------

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        """Run the prompt and sample its first token; the blocks stay pinned for a pull."""
        if not self.accepting:
            raise WorkerLeavingError(f"worker {self.worker_id} is draining")
        start = time.monotonic()
        rid = req.request_id
        prompt = {"prompt_token_ids": req.prompt_token_ids}
        stream = await self.llm.add_request(
            rid, prompt, prefill_params(req.params), kv_lease=self.kv_config.lease_seconds
        )
        final = None
        handed_off = False
        try:
            async for out in stream:
                final = out
            if final.outputs[0].finish_reason == "abort" or not final.outputs[0].token_ids:
                raise RuntimeError(f"prefill of {rid} was aborted")
            self.ttft.record(time.monotonic() - start)
            ticket = await self.llm.call(self.llm.engine.kv_ticket, self.worker_id, rid)
            handed_off = True
        finally:
            if not handed_off:  # cancelled (the client left): stop it and let any pin go
                self.llm.abort(rid)
                asyncio.ensure_future(self.llm.call(self.llm.engine.release_kv, rid))
        first = final.outputs[0]
        first_logprobs = None
        if first.logprobs:
            entry = first.logprobs[0]
            lp = entry[first.token_ids[0]]
            top = [(t, e.logprob) for t, e in sorted(entry.items(), key=lambda kv: kv[1].rank)]
            first_logprobs = (lp.logprob, lp.rank, top[: req.params.logprobs])
        metrics = final.metrics
        return PrefillResult(
            rid,
            first.token_ids[0],
            first_logprobs,
            ticket,
            final.num_cached_tokens,
            queue_seconds=metrics.time_in_queue if metrics is not None else None,
            cost_usd=self.price_per_hour / 3600.0 * (metrics.step_seconds if metrics is not None else 0.0),
        )

    async def release_kv(self, request_id: str) -> bool:
        """The decode side confirms its pull (or gives up): unpin the ticket's blocks."""
        self._end_hold(request_id)
        return await self.llm.call(self.llm.engine.release_kv, request_id)

    async def hold_kv(self, request_id: str) -> list[int] | None:
        """A multi-shard pull is starting: keep the pin from expiring until `release_kv`
        (or twice the pull timeout, should the decode side vanish). None: lease over."""
        if request_id in self.holds:
            return None
        blocks = self.llm.engine.pins.begin_read(request_id)
        if blocks is not None:
            later = 2 * self.kv_config.pull_timeout_seconds
            self.holds[request_id] = asyncio.get_running_loop().call_later(later, self._end_hold, request_id)
        return blocks

    def _end_hold(self, request_id: str) -> None:
        timer = self.holds.pop(request_id, None)
        if timer is not None:
            timer.cancel()
            self.llm.engine.pins.end_read(request_id)

    async def shard_handles(self) -> list:
        return self.shards

    async def send_piece(self, peer_id: str, tag: int, blocks: list[int], layers: range, heads: range) -> int:
        return await asyncio.to_thread(self.source.send_piece, peer_id, tag, blocks, layers, heads)

    async def export_piece(self, blocks: list[int], layers: range, heads: range) -> torch.Tensor:
        return await self.source.export_piece(blocks, layers, heads)

    async def export_kv(self, request_id: str) -> torch.Tensor | None:
        return await self.source.export_kv(request_id)

    async def join_pair(self, peer_id: str, host: str, port: int, key: str, backend: str) -> None:
        await self.source.join_pair(peer_id, host, port, key, backend, self.kv_config.pull_timeout_seconds)

    # ---- decode role --------------------------------------------------------------------

    async def decode(self, req: EngineRequest, handoff: PrefillResult, prefill=None) -> None:
        """Continue a prefilled request here. Returns once it is accepted: its first
        token goes out at once (under the same stop-string rules as the rest), then the
        KV is pulled (or recomputed) and the request joins the batch."""
        outbox = self._admit(req)
        rid = req.request_id
        try:
            _, blocks = await self.llm.add_prefilled_request(
                rid,
                {"prompt_token_ids": req.prompt_token_ids},
                req.params,
                handoff.first_token,
                handoff.first_logprobs,
                sink=outbox,
            )
        except BaseException:
            outbox.unregister(rid)
            raise
        if blocks is not None:
            self.pulling[rid] = False
            asyncio.ensure_future(self._pull(handoff, prefill, rid, blocks))
        elif handoff.ticket is not None and prefill is not None:
            prefill.release_kv.remote(rid)  # nothing to pull: let the pin go now

    async def _pull(self, handoff: PrefillResult, prefill, rid: str, blocks: list[int]) -> None:
        """Runs to its end even if the request is aborted meanwhile: a pull cut off midway
        would break the pair group and leave the blocks half written."""
        ok = False
        try:
            ok = await self.puller.pull(handoff.ticket, prefill, self.llm.engine.runner.kv_cache, blocks)
        finally:
            await self.llm.call(self.llm.engine.finish_kv_pull, rid, ok)
            if self.pulling.pop(rid, False):  # aborted while its blocks were being written
                self.llm.abort(rid)

    # ---- mixed role and common ----------------------------------------------------------

    async def generate(self, req: EngineRequest) -> None:
        """Run a whole request here (colocated); returns once it is accepted."""
        outbox = self._admit(req)
        try:
            await self.llm.add_request(
                req.request_id, {"prompt_token_ids": req.prompt_token_ids}, req.params, sink=outbox
            )
        except BaseException:
            outbox.unregister(req.request_id)
            raise

    async def abort(self, request_id: str) -> None:
        if request_id in self.pulling:  # its blocks are being written: abort after the pull
            self.pulling[request_id] = True
            return
        self.llm.abort(request_id)

    async def generate_batch(
        self, request_ids: list[str], prompts: list, params: list[SamplingParams], priorities: list[int]
    ) -> list[RequestOutput]:
        """The offline API's batch: every prompt validated before any is queued; the final
        output of each, in order."""

        def validate() -> None:
            engine = self.llm.engine
            for prompt, p in zip(prompts, params):
                engine.validate(engine.tokenize(prompt)[1], p)

        await self.llm.call(validate)
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

    async def kv_cache_stats(self):
        return await self.llm.call(self.llm.engine.kv_cache_stats)

    async def load_signals(self) -> dict[str, float]:
        """Autoscaling signals (actors/signals.py): queues now, latencies lately."""
        signals = await self.llm.call(engine_load, self.llm.engine)
        outbox = self._outbox()
        ttft = self.ttft if self.role == "prefill" else outbox.ttft
        return {**signals, "ttft_seconds": ttft.mean(), "itl_seconds": outbox.itl.mean()}

    async def model_info(self) -> dict:
        """What a front needs to validate prompts before sending them here."""
        e = self.llm.engine
        return {"max_model_len": e.max_model_len, "vocab_size": e.hf_config.vocab_size}

    async def stats(self) -> WorkerStats:
        shard_sent = 0  # KV bytes this worker's other shards sent to decode shards
        if self.shards and self.role != "decode":
            shard_sent = sum(await asyncio.gather(*(s.bytes_sent.remote() for s in self.shards)))

        def read() -> WorkerStats:
            e = self.llm.engine
            kv = e.kv_cache_stats()
            return WorkerStats(
                worker_id=self.worker_id,
                role=self.role,
                num_running=len(e.scheduler.running),
                num_waiting=len(e.scheduler.waiting),
                kv_usage=kv.usage,
                used_blocks=kv.used_blocks,
                pinned=len(e.pins),
                kv_transfer_bytes=self.puller.bytes_pulled + self.source.bytes_sent + shard_sent,
                kv_transfer_seconds=self.puller.seconds,
                kv_pull_buckets=list(self.puller.buckets),
                kv_recomputes=e.num_kv_recomputes,
                prefix_queries=e.kv.prefix_queries,
                prefix_hits=e.kv.prefix_hits,
                num_preemptions=e.scheduler.num_preemptions,
                accepting=self.accepting,
            )

        return await self.llm.call(read)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)  # its loop releases the shards' serve loops
        for shard in self.shards:
            ray.kill(shard)
        self.shards = []


def _exit_group(error: BaseException) -> None:
    logger.error("kvray worker: a sharded step failed (%r); exiting so the group is replaced", error)
    os._exit(1)
