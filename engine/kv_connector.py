"""The engine's half of a KV hand-off, in two parts: what a prefill engine holds for a
decode worker's pull, and what a decode engine has reserved for a pull that is arriving.

The scheduler knows nothing about hand-offs. When a request finishes it asks its
connector (`request_finished`, the shape of vLLM's `KVConnectorBase_V1`) whether the
request's blocks must be held; if so they leave the request's table without being freed
and the connector owns them until it releases them. The transfer itself (pack, send,
receive, unpack) is the workers' part: `kvray.actors.connectors`.
"""

from __future__ import annotations

import time
from typing import Protocol

from kvray.engine.kv_cache_manager import KVCacheManager
from kvray.engine.kv_transfer import KVLayout, KVTicket, PinTable
from kvray.engine.request import Request, RequestStatus

# a pull begun later than this before its prefill's pin lapses may find the blocks gone: a
# request waiting for room recomputes its prompt instead
PULL_MARGIN_S = 1.0


class KVConnectorScheduler(Protocol):
    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """`request` has just finished (its status says how): True to keep its blocks
        (they become the connector's), False to let the scheduler free them."""
        ...


class PrefillHandoff:
    """Prefills for a decode worker: at finish their prompt blocks are pinned under a
    lease, a `KVTicket` names them, and they go back to the pool when the decode side
    confirms its pull (`release`) or the lease ends (`expire`)."""

    def __init__(self, kv: KVCacheManager, block_size: int):
        self.kv = kv
        self.block_size = block_size
        self.leases: dict[str, float] = {}  # request id -> seconds to hold its blocks
        self.pins = PinTable()

    def expect(self, request_id: str, lease_seconds: float) -> None:
        """`request_id` is a prefill: hold its blocks for `lease_seconds` when it finishes."""
        self.leases[request_id] = lease_seconds

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        lease = self.leases.pop(request.request_id, None)
        if lease is None or request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            return False
        self.pins.add(
            request.request_id,
            block_ids,
            time.time() + lease,
            request.num_prompt_tokens,
            tuple(request.block_hashes),
        )
        return True

    def ticket(self, worker_id: str, request_id: str, layout: KVLayout) -> KVTicket | None:
        """The ticket of a finished prefill (None if its blocks are not pinned)."""
        pin = self.pins.pins.get(request_id)
        if pin is None:
            return None
        full_blocks = pin.num_tokens // self.block_size
        return KVTicket(
            worker_id,
            request_id,
            tuple(pin.blocks),
            pin.num_tokens,
            pin.block_hashes[:full_blocks],
            layout,
            pin.deadline,
        )

    def release(self, request_id: str) -> bool:
        """Unpin (the pull is done, or given up); False if absent or being read (a pin being
        read goes at the engine's next `expire`, once the read ends)."""
        blocks = self.pins.pop(request_id)
        if blocks is None:
            return False
        self.kv.release(blocks)
        return True

    def expire(self, now: float) -> None:
        for rid in self.pins.expired(now):
            self.release(rid)

    def __len__(self) -> int:
        return len(self.pins)


class DecodeHandoff:
    """Requests prefilled elsewhere whose prompt KV is being written into blocks reserved
    here, and those waiting for blocks to pull into: first come first served, each while
    its prefill's pin lasts (vLLM's decode side waits so too). They are outside the
    scheduler until the pull reports back; one that will not pull (no pin, its pin about to
    lapse, a failed pull) is the caller's to queue for recompute."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.pulls: dict[str, Request] = {}
        self.waiting: dict[str, tuple[Request, float]] = {}  # request id -> (it, pin's end)
        self.num_recomputes = 0  # prompts recomputed here: no pin left to wait on, or a pull failed

    def reserve(self, request: Request, pin_end: float | None) -> list[int] | None:
        """Blocks for `request`'s prompt (its first token appended; not indexed in the
        prefix cache until the data has arrived); it is then pulling. None: it waits for
        room (behind any already waiting) while its pin (`pin_end`, wall-clock) lasts, or,
        with none or one about to lapse, is to be recomputed (counted here)."""
        if pin_end is None or not self.waiting:
            blocks = self.kv.allocate_slots(request, request.num_prompt_tokens, cache=False)
            if blocks is not None:
                self.pulls[request.request_id] = request
                return blocks
        if pin_end is not None and time.time() < pin_end - PULL_MARGIN_S:
            self.waiting[request.request_id] = (request, pin_end)
        else:
            self.num_recomputes += 1
        return None

    def grant(
        self, now: float, may_allocate: bool
    ) -> tuple[list[tuple[str, list[int] | None]], list[Request]]:
        """The waiting requests' turn, in order: (request id, blocks to pull into) for each
        that now fits while `may_allocate`, (request id, None) for each that leaves without
        a pull: aborted meanwhile, or its pin about to lapse (these also come back, as the
        requests to recompute). The first that does not fit stops the allocating (those
        behind it wait on), not the leaving."""
        decided: list[tuple[str, list[int] | None]] = []
        lapsed: list[Request] = []
        for rid, (req, pin_end) in list(self.waiting.items()):
            if req.finished or now >= pin_end - PULL_MARGIN_S:
                if not req.finished:
                    self.num_recomputes += 1
                    lapsed.append(req)
                blocks = None
            else:
                blocks = (
                    self.kv.allocate_slots(req, req.num_prompt_tokens, cache=False) if may_allocate else None
                )
                if blocks is None:
                    may_allocate = False
                    continue
                self.pulls[rid] = req
            del self.waiting[rid]
            decided.append((rid, blocks))
        return decided, lapsed

    def finish(self, request_id: str) -> Request | None:
        return self.pulls.pop(request_id, None)

    def get(self, request_id: str) -> Request | None:
        """A request pulling or waiting to."""
        waiting = self.waiting.get(request_id)
        return self.pulls.get(request_id) or (waiting[0] if waiting else None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.pulls or request_id in self.waiting

    def __len__(self) -> int:
        return len(self.pulls) + len(self.waiting)
