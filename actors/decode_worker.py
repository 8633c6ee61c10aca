"""The decode role: take (request, first token, ticket) (`decode`), reserve blocks (or
wait for some to free up, while the prefill's pin lasts), pull the prompt's KV through
this worker's connector, and continue the request in the continuous batch. A failed pull,
or a pin that would lapse before blocks free up, recomputes the prompt here (counted in
`kv_recomputes`).

This is the pulling half of a KV hand-off (actors/kv_pull.py, actors/kv_transport.py).
"""

from __future__ import annotations

import asyncio
import time

from kvray.actors.kv_pull import KVPuller
from kvray.actors.kv_transport import connector_class
from kvray.actors.messages import EngineRequest, PrefillResult
from kvray.actors.worker import EngineWorker, Role


class DecodeWorker(EngineWorker):
    role: Role = "decode"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        backend = "nccl" if self.llm.device.type == "cuda" else "gloo"
        connector_type = connector_class(self.kv_config.connector)
        connector = connector_type(self.worker_id, self.kv_config, self.host, backend)
        self.puller = KVPuller(connector, self.llm.kv_layout, self.shards)

    async def decode(self, req: EngineRequest, handoff: PrefillResult, prefill=None) -> None:
        """Continue a prefilled request here. Returns once it is accepted: its first
        token goes out at once (under the same stop-string rules as the rest), then the
        KV is pulled (or recomputed) and the request joins the batch."""
        outbox = self._admit(req, prefilled=True)
        rid = req.request_id
        ticket = handoff.ticket
        pin_deadline = None  # (None: no pin to wait on, recompute when there is no room now)
        if ticket is not None and prefill is not None:
            pin_deadline = ticket.lease_deadline  # (the engine applies the lease policy to it)
        try:
            _, room = await self.llm.add_prefilled_request(
                rid,
                {"prompt_token_ids": req.prompt_token_ids},
                req.params,
                handoff.first_token,
                handoff.first_logprobs,
                sink=outbox,
                pull_deadline=pin_deadline,
                priority=req.priority,
            )
        except BaseException:
            outbox.unregister(rid)
            raise
        self._start(self._pull(handoff, prefill, rid, room, req.trace))

    async def _pull(
        self, handoff: PrefillResult, prefill, rid: str, room: asyncio.Future, trace: dict | None = None
    ) -> None:
        """Once the engine has blocks for it (at once, or when some free up), pull the
        prompt's KV into them. Runs to its end even if the request is aborted meanwhile: a
        pull cut off midway would break the pair group and leave the blocks half written
        (the engine frees an aborted request's blocks when its pull reports back). Traced:
        a `kv_pull` span from the request's arrival here to the pull's end."""
        arrived = time.time_ns()
        blocks = await room
        if blocks is None:  # nothing to pull (ended, aborted, or recomputed here)
            if handoff.ticket is not None and prefill is not None:
                prefill.release_kv.remote(rid)  # let the pin go now
            return
        ok = False
        pulling = time.time_ns()
        try:
            ok = await self.puller.pull(handoff.ticket, prefill, self.llm.kv_views.of(blocks))
        finally:
            await self.llm.finish_kv_pull(rid, ok)
            if self.tracing is not None and trace is not None:
                attributes = {
                    **self.span_attributes,
                    "kvray.kv_pull.ok": ok,
                    "kvray.kv_pull.blocks": len(blocks),
                    "kvray.kv_pull.wait_seconds": (pulling - arrived) / 1e9,
                    "kvray.kv_transfer.connector": self.kv_config.connector,
                }
                self.tracing.record("kv_pull", trace, arrived, time.time_ns(), attributes)

    async def _transfer(self) -> tuple[int, float, list[int]]:
        p = self.puller
        return p.bytes_pulled, p.seconds, list(p.buckets)
