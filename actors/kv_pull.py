"""The decode side of a KV hand-off: pull a prefilled prompt's blocks into reserved blocks
of this worker's cache, through its connector, rank to rank when either side is sharded.

A pull that fails (lease over, peer gone, timeout, layouts that do not fit) is logged with
its cause and reported as not ok: the engine then recomputes the prompt here. Whatever
happens, the prefill side is told to let its pin go.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time

from kvray.actors.kv_transport import KVConnector, KVPullError
from kvray.actors.messages import TRANSFER_BUCKETS
from kvray.actors.shard_group import pull_pieces
from kvray.engine.kv_transfer import KVLayout, KVTicket, plan_kv_pull
from kvray.engine.kv_views import BlockView

logger = logging.getLogger(__name__)


class KVPuller:
    def __init__(self, connector: KVConnector, layout: KVLayout, shards: list):
        self.connector = connector
        self.layout = layout  # this worker's cache layout
        self.shards = shards  # this worker's ranks 1.. (each pulls its own pieces)
        self.peer_shards: dict[str, list] = {}  # prefill worker id -> its shard handles
        self.bytes_pulled = 0
        self.seconds = 0.0
        self.buckets = [0] * (len(TRANSFER_BUCKETS) + 1)  # pulls per duration bucket, +Inf last

    async def pull(self, ticket: KVTicket | None, prefill, into: BlockView) -> bool:
        """Fill `into` (the blocks reserved for it) with the ticket's KV; True on success.
        Never raises a pull failure."""
        start = time.perf_counter()
        try:
            if ticket is None or prefill is None:
                raise KVPullError("no ticket (the prefill could not pin its blocks)")
            try:
                self.layout.check_pull_from(ticket.layout)
            except ValueError as e:
                raise KVPullError(str(e)) from e
            if ticket.layout.num_shards == 1 and self.layout.num_shards == 1:
                moved = await self.connector.pull(ticket, prefill, into)
            else:
                moved = await self._pull_sharded(ticket, prefill, into)
        except Exception as e:  # KVPullError, or the prefill worker went away (not a cancel)
            rid = ticket.request_id if ticket is not None else "?"
            logger.warning("kvray worker: KV pull of %s failed, recomputing: %s", rid, e)
            return False
        finally:
            if ticket is not None and prefill is not None:
                prefill.release_kv.remote(ticket.request_id)
        elapsed = time.perf_counter() - start
        self.bytes_pulled += moved
        self.seconds += elapsed
        self.buckets[bisect.bisect_left(TRANSFER_BUCKETS, elapsed)] += 1
        return True

    async def _pull_sharded(self, ticket: KVTicket, prefill, into: BlockView) -> int:
        """Shard to shard: every decode shard receives exactly its layers x heads, each
        from the prefill shard that holds them (heads re-sharded when tp differs). The
        hold lasts two pull timeouts: every piece starts within the first, so it ends
        (done or timed out) inside the hold."""
        start_by = time.time() + self.connector.lease.pull_timeout_s
        src_blocks = await prefill.hold_kv.remote(ticket.request_id)
        if src_blocks is None:
            raise KVPullError(f"lease of {ticket.request_id} ended before the pull")
        peer = ticket.worker_id
        if peer not in self.peer_shards:
            self.peer_shards[peer] = await prefill.shard_handles.remote()
        sources = [prefill, *self.peer_shards[peer]]
        source_ids = [peer, *(f"{peer}/{r}" for r in range(1, len(sources)))]
        by_rank: dict[int, list] = {}
        for piece in plan_kv_pull(ticket.layout, self.layout):
            by_rank.setdefault(piece.dst_rank, []).append(piece)
        args = (sources, source_ids)
        tail = (ticket.layout, self.layout, src_blocks, start_by)
        parts = [
            pull_pieces(self.connector, into, *args, pieces, *tail)
            if rank == 0  # a shard fills the same blocks of its own cache
            else self.shards[rank - 1].pull_pieces.remote(into.blocks, *args, pieces, *tail)
            for rank, pieces in by_rank.items()
        ]
        results = await asyncio.gather(*parts, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise KVPullError(f"sharded pull of {ticket.request_id} failed: {r!r}")
        return sum(results)
