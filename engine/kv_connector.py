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
        if lease is None or request.status is RequestStatus.FINISHED_ABORTED:
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
    here, and those waiting for blocks to pull into (in arrival order, each until its
    prefill's pin would lapse). They are outside the scheduler until the pull reports back."""

    def __init__(self) -> None:
        self.pulls: dict[str, Request] = {}
        self.waiting: dict[str, tuple[Request, float]] = {}  # request id -> (it, pin deadline)
        self.num_recomputes = 0  # prompts recomputed here: a pin lapsed waiting, or a pull failed

    def begin(self, request: Request) -> None:
        self.pulls[request.request_id] = request

    def finish(self, request_id: str) -> Request | None:
        return self.pulls.pop(request_id, None)

    def get(self, request_id: str) -> Request | None:
        return self.pulls.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.pulls or request_id in self.waiting

    def __len__(self) -> int:
        return len(self.pulls) + len(self.waiting)
