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
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

import torch

from kvray.actors.connectors import CONNECTORS, KVPullError, KVSource
from kvray.configs import KVTransferConfig
from kvray.engine import AsyncLLM, EngineConfig, RequestOutput, SamplingParams
from kvray.engine.kv_transfer import KVTicket, prefill_params

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
    ):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.worker_id = worker_id
        self.role = role
        self.kv_config = KVTransferConfig(**(kv_config or {}))
        self.llm = AsyncLLM(EngineConfig(**engine_config))
        engine = self.llm.engine
        self.source = KVSource(engine.pins, engine.runner.kv_cache, engine.device, engine.kv_layout)
        backend = "nccl" if engine.device.type == "cuda" else "gloo"
        host = _node_ip()
        self.connector = CONNECTORS[self.kv_config.connector](worker_id, self.kv_config, host, backend)
        self.pulled_bytes = 0
        self.pull_seconds = 0.0
        self.pulling: dict[str, bool] = {}  # request id -> abort once its pull is done

    async def ready(self) -> str:
        return self.worker_id

    # ---- prefill role -------------------------------------------------------------------

    async def prefill(self, request_id: str, prompt, params: SamplingParams) -> PrefillResult:
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
        )

    async def release_kv(self, request_id: str) -> bool:
        """The decode side confirms its pull (or gives up): unpin the ticket's blocks."""
        return await self.llm.call(self.llm.engine.release_kv, request_id)

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
            moved = await self.connector.pull(ticket, prefill, self.llm.engine.runner.kv_cache, blocks)
            self.pulled_bytes += moved
            self.pull_seconds += time.perf_counter() - start
            ok = True
        except KVPullError:
            pass  # recomputed below, counted by the engine
        finally:
            await self.llm.call(self.llm.engine.finish_kv_pull, request_id, ok)
            if ticket is not None and prefill is not None:
                prefill.release_kv.remote(request_id)
            if self.pulling.pop(request_id, False):  # aborted while its blocks were being written
                self.llm.abort(request_id)

    # ---- mixed role and common ----------------------------------------------------------

    async def generate(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        stream = await self.llm.add_request(request_id, prompt, params)
        async for out in self._stream(stream):
            yield out

    async def _stream(self, stream) -> AsyncIterator[RequestOutput]:
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:  # the caller went away: abort and free the blocks
                self.llm.abort(stream.request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self.pulling:  # its blocks are being written: abort after the pull
            self.pulling[request_id] = True
            return
        self.llm.abort(request_id)

    async def model_info(self) -> dict:
        """What a front needs to validate prompts before sending them here."""
        e = self.llm.engine
        return {"max_model_len": e.max_model_len, "vocab_size": e.hf_config.vocab_size}

    async def stats(self) -> WorkerStats:
        def read() -> WorkerStats:
            e = self.llm.engine
            kv = e.kv_cache_stats()
            return WorkerStats(
                self.worker_id,
                self.role,
                len(e.scheduler.running),
                len(e.scheduler.waiting),
                kv.usage,
                kv.used_blocks,
                len(e.pins),
                self.pulled_bytes + self.source.bytes_sent,
                self.pull_seconds,
                e.num_kv_recomputes,
                e.kv.prefix_queries,
                e.kv.prefix_hits,
                e.scheduler.num_preemptions,
            )

        return await self.llm.call(read)

    async def shutdown(self) -> None:
        self.llm.shutdown()


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return os.environ.get("KVRAY_HOST", "127.0.0.1")
