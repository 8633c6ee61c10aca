"""Engine workers: one Ray actor per engine, in the role `prefill`, `decode` or `mixed`.

* prefill: runs the prompt (chunked, prefix-cached), samples the first token and
  returns it with a KVTicket; the prompt's blocks stay pinned until the decode side
  confirms its pull (`release_kv`) or the lease ends.
* decode: takes (request, first token, ticket), reserves blocks, pulls the KV through its
  connector, confirms, and continues the request in its continuous batch, streaming
  outputs. A failed pull recomputes the prompt here (counted in `kv_recomputes`).
* mixed: both phases in one engine, nothing moves (colocated mode).

The worker is an async actor: engine steps run on the AsyncLLM's own thread, so the
actor's event loop stays free for pulls, aborts and health checks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

import ray
import torch

from kvray.actors.connectors import CONNECTORS, KVPullError, KVSource
from kvray.actors.shard_group import node_ip, pull_pieces, start_shards
from kvray.actors.signals import RecentMean, engine_load
from kvray.configs import KVTransferConfig
from kvray.engine import AsyncLLM, EngineConfig, RequestOutput, SamplingParams
from kvray.engine.kv_transfer import KVTicket, plan_kv_pull, prefill_params
from kvray.engine.outputs import RequestMetrics

logger = logging.getLogger(__name__)
Role = Literal["prefill", "decode", "mixed"]


@dataclass
class PrefillResult:
    """What a prefill hands to the router for the decode worker."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    first_token: int
    first_logprobs: tuple | None  # (logprob, rank, top) of the first token, when asked
    ticket: KVTicket | None  # None when the blocks could not be pinned
    num_cached_tokens: int
    metrics: RequestMetrics | None = None  # the prefill engine's timings; its queue time counts


@dataclass
class WorkerStats:
    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    kv_usage: float  # used / total blocks
    used_blocks: int
    pinned: int  # tickets whose blocks are still pinned
    kv_transfer_bytes: int  # bytes pulled in (decode) plus bytes sent out (prefill)
    kv_transfer_seconds: float  # time spent pulling (decode side)
    # durations of the pulls finished since the previous stats() call (drained by it)
    kv_pull_durations: list[float]
    kv_recomputes: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int = 0


class EngineWorker:
    def __init__(
        self,
        worker_id: str,
        role: Role,
        engine_config: dict,
        kv_config: dict | None = None,
        torch_threads: int | None = None,
        shard_resources: dict | None = None,
    ):
        """`shard_resources` ({"num_cpus", "num_gpus"}): what each of the other shards of a
        tp x pp > 1 worker reserves; they start in this actor's placement group."""
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
        self.connector = CONNECTORS[self.kv_config.connector](worker_id, self.kv_config, host, backend)
        self.pulled_bytes = 0
        self.pull_seconds = 0.0
        self.pull_durations: list[float] = []  # drained by stats()
        self.pulling: dict[str, bool] = {}  # request id -> abort once its pull is done
        self.holds: dict[str, asyncio.TimerHandle] = {}  # prefill: pins held for sharded pulls
        self.peer_shards: dict[str, list] = {}  # prefill worker id -> its shard handles
        self.ttft = RecentMean()  # seconds from arrival here to the first token
        self.itl = RecentMean()  # seconds between a stream's outputs, per token

    async def ready(self) -> str:
        """Health: this actor and every shard of its group are alive."""
        await asyncio.gather(*(shard.ready.remote() for shard in self.shards))
        return self.worker_id

    # ---- prefill role -------------------------------------------------------------------

    async def prefill(self, request_id: str, prompt, params: SamplingParams) -> PrefillResult:
        start = time.monotonic()
        stream = await self.llm.add_request(
            request_id, prompt, prefill_params(params), kv_lease=self.kv_config.lease_seconds
        )
        final = None
        handed_off = False
        try:
            async for out in stream:
                final = out
            if final.outputs[0].finish_reason == "abort" or not final.outputs[0].token_ids:
                raise RuntimeError(f"prefill of {request_id} was aborted")
            first = final.outputs[0]
            self.ttft.record(time.monotonic() - start)
            ticket = await self.llm.call(self.llm.engine.kv_ticket, self.worker_id, request_id)
            handed_off = True
        finally:
            if not handed_off:  # cancelled (the client left): stop it and let any pin go
                self.llm.abort(request_id)
                asyncio.ensure_future(self.llm.call(self.llm.engine.release_kv, request_id))
        first_logprobs = None
        if first.logprobs:
            entry = first.logprobs[0]
            lp = entry[first.token_ids[0]]
            top = [(t, e.logprob) for t, e in sorted(entry.items(), key=lambda kv: kv[1].rank)]
            first_logprobs = (lp.logprob, lp.rank, top[: params.logprobs])
        return PrefillResult(
            request_id,
            final.prompt,
            final.prompt_token_ids,
            first.token_ids[0],
            first_logprobs,
            ticket,
            final.num_cached_tokens,
            final.metrics,
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

    async def decode(
        self, request_id: str, params: SamplingParams, handoff: PrefillResult, prefill=None
    ) -> AsyncIterator[RequestOutput]:
        prompt = {"prompt": handoff.prompt, "prompt_token_ids": handoff.prompt_token_ids}
        stream, blocks = await self.llm.add_prefilled_request(
            request_id, prompt, params, handoff.first_token, handoff.first_logprobs
        )
        if blocks is not None:
            # shielded: a pull cut off midway would break the pair group and leave the
            # blocks half written; a cancelled caller aborts the request once it is done
            pull = asyncio.ensure_future(self._pull(handoff.ticket, prefill, request_id, blocks))
            self.pulling[request_id] = False
            try:
                await asyncio.shield(pull)
            except asyncio.CancelledError:
                self.pulling[request_id] = True
                raise
        elif handoff.ticket is not None and prefill is not None:
            prefill.release_kv.remote(request_id)  # nothing to pull: let the pin go now
        async for out in self._stream(stream):
            yield out

    async def _pull(self, ticket: KVTicket | None, prefill, request_id: str, blocks: list[int]) -> None:
        ok = False
        start = time.perf_counter()
        try:
            if ticket is None or prefill is None:
                raise KVPullError(f"no ticket for {request_id}")
            if ticket.layout.num_shards == 1 and self.llm.engine.kv_layout.num_shards == 1:
                moved = await self.connector.pull(ticket, prefill, self.llm.engine.runner.kv_cache, blocks)
            else:
                moved = await self._pull_sharded(ticket, prefill, blocks)
            self.pulled_bytes += moved
            elapsed = time.perf_counter() - start
            self.pull_seconds += elapsed
            self.pull_durations.append(elapsed)
            ok = True
        except Exception:  # KVPullError, or the prefill worker went away (not a cancel)
            pass  # recomputed below, counted by the engine
        finally:
            await self.llm.call(self.llm.engine.finish_kv_pull, request_id, ok)
            if ticket is not None and prefill is not None:
                prefill.release_kv.remote(request_id)
            if self.pulling.pop(request_id, False):  # aborted while its blocks were being written
                self.llm.abort(request_id)

    async def _pull_sharded(self, ticket: KVTicket, prefill, blocks: list[int]) -> int:
        """Shard to shard: every decode shard receives exactly its layers x heads, each
        from the prefill shard that holds them (heads re-sharded when tp differs). The
        hold lasts two pull timeouts: every piece starts within the first, so it ends
        (done or timed out) inside the hold."""
        start_by = time.time() + self.kv_config.pull_timeout_seconds
        src_blocks = await prefill.hold_kv.remote(ticket.request_id)
        if src_blocks is None:
            raise KVPullError(f"lease of {ticket.request_id} ended before the pull")
        peer = ticket.worker_id
        if peer not in self.peer_shards:
            self.peer_shards[peer] = await prefill.shard_handles.remote()
        sources = [prefill, *self.peer_shards[peer]]
        source_ids = [peer, *(f"{peer}/{r}" for r in range(1, len(sources)))]
        src_layout, dst_layout = ticket.layout, self.llm.engine.kv_layout
        by_rank: dict[int, list] = {}
        for piece in plan_kv_pull(src_layout, dst_layout):
            by_rank.setdefault(piece.dst_rank, []).append(piece)
        args = (sources, source_ids)
        tail = (src_layout, dst_layout, src_blocks, blocks, start_by)
        kv_cache = self.llm.engine.runner.kv_cache
        parts = [
            pull_pieces(self.connector, kv_cache, *args, pieces, *tail)
            if rank == 0
            else self.shards[rank - 1].pull_pieces.remote(*args, pieces, *tail)
            for rank, pieces in by_rank.items()
        ]
        results = await asyncio.gather(*parts, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise KVPullError(f"sharded pull of {ticket.request_id} failed: {r!r}")
        return sum(results)

    # ---- mixed role and common ----------------------------------------------------------

    async def generate(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        stream = await self.llm.add_request(request_id, prompt, params)
        async for out in self._stream(stream):
            yield out

    async def _stream(self, stream) -> AsyncIterator[RequestOutput]:
        start = last = time.monotonic()
        tokens = None  # generated tokens at the previous output
        try:
            async for out in stream:
                now, n = time.monotonic(), len(out.outputs[0].token_ids) if out.outputs else 0
                if tokens is None and n and self.role == "mixed":
                    self.ttft.record(now - start)
                elif tokens is not None and n > tokens:
                    self.itl.record((now - last) / (n - tokens))
                if n:
                    tokens, last = n, now
                yield out
        finally:
            if not stream.finished:  # the caller went away: abort and free the blocks
                self.llm.abort(stream.request_id)

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
            async for out in self._stream(stream):  # noqa: B007 (keep the last)
                pass
            return out

        return list(await asyncio.gather(*(final(s) for s in streams)))

    async def kv_cache_stats(self):
        return await self.llm.call(self.llm.engine.kv_cache_stats)

    async def load_signals(self) -> dict[str, float]:
        """Autoscaling signals (actors/signals.py): queues now, latencies lately."""
        signals = await self.llm.call(engine_load, self.llm.engine)
        return {**signals, "ttft_seconds": self.ttft.mean(), "itl_seconds": self.itl.mean()}

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
            durations, self.pull_durations = self.pull_durations, []
            kv = e.kv_cache_stats()
            return WorkerStats(
                self.worker_id,
                self.role,
                len(e.scheduler.running),
                len(e.scheduler.waiting),
                kv.usage,
                kv.used_blocks,
                len(e.pins),
                self.pulled_bytes + self.source.bytes_sent + shard_sent,
                self.pull_seconds,
                durations,
                e.num_kv_recomputes,
                e.kv.prefix_queries,
                e.kv.prefix_hits,
                e.scheduler.num_preemptions,
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
