"""One engine's share of every KV hand-off, owned on its engine thread.

A prefill engine finishes a request after its first token but keeps the prompt's blocks
*pinned* (still counted as used) under a lease; a `KVTicket` names them. A decode engine
reserves blocks for the prompt, a transport pulls the bytes into them (actors/
kv_transport.py: the workers' half), and the pull's end admits the request to the batch
(or, when it failed, queues its prompt for recompute). The scheduler knows nothing of
this: at each finish it asks `request_finished` (the shape of vLLM's
`KVConnectorBase_V1` scheduler half) whether the blocks are held.

`KVHandoff` holds both sides' state, changed only on the engine thread:

    prefill side   expect -> request_finished (pinned) -> ticket -> release | lease ends
    decode side    admit_prefilled -> blocks now | waits for room | recompute
                   on_step: rooms granted as blocks free up, pins that lapsed released,
                   waiting requests whose pin is about to lapse sent to recompute
                   finish_pull(ok) -> running | recompute ; abort marks, never frees early

`PinTable` is the one part other threads see: a transfer reads pinned blocks under
`begin_read`/`end_read`, and a multi-shard pull's driver keeps them under `hold`/`unhold`,
so a pin being read or held never lapses under it. `LeasePolicy` holds the timing rules
workers, engines, transports and the simulator apply.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvray.engine.kv_cache_manager import KVCacheManager
from kvray.engine.kv_transfer import KVLayout, KVTicket
from kvray.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class LeasePolicy:
    """The hand-off's timing rules (seconds; wall-clock times are time.time())."""

    lease_s: float = 30.0  # how long a prefill's blocks stay pinned for the pull
    pull_timeout_s: float = 30.0  # a pull slower than this is given up (recompute)
    # a pull begun later than this before its prefill's pin lapses may find the blocks
    # gone: a request waiting for room recomputes its prompt instead
    pull_margin_s: float = 1.0

    def pin_end(self, ticket_deadline: float, now: float) -> float:
        """The pin's end as the decode side counts it: the ticket's (the prefill host's
        clock) and this host's own count of the lease, whichever is sooner."""
        return min(ticket_deadline, now + self.lease_s)

    def may_wait(self, pin_end: float | None, now: float) -> bool:
        """Whether a request without room may still wait for blocks and then pull."""
        return pin_end is not None and now < pin_end - self.pull_margin_s

    @property
    def hold_s(self) -> float:
        """How long a multi-shard pull holds its pin: every piece starts within one pull
        timeout, so each ends (done or timed out) inside two."""
        return 2 * self.pull_timeout_s


@dataclass
class _Pin:
    blocks: list[int]
    deadline: float
    num_tokens: int
    block_hashes: tuple[bytes, ...]
    readers: int = 0
    released: bool = False  # let go while being read: goes when the last read ends
    held_until: float = 0.0  # a multi-shard pull's hold: kept (even past the lease) until then


@dataclass
class PinTable:
    """Pinned blocks per request. Readers (a transfer in flight, any thread) hold a pin
    against expiry and release; releasing blocks to the pool is left to the engine thread.

    A release can overtake the read it confirms: a torch_dist pull's receiver has every
    byte, and says so, before the sender's last send has returned. Such a pin is marked
    released and `expired` lists it as soon as its last read ends.

    A multi-shard pull's driver `hold`s a pin while its shards send their pieces of the
    blocks: until the decode side releases it, or for `hold_s` should it vanish."""

    hold_s: float = LeasePolicy().hold_s
    pins: dict[str, _Pin] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(
        self,
        request_id: str,
        blocks: list[int],
        deadline: float,
        num_tokens: int,
        block_hashes: tuple[bytes, ...],
    ) -> None:
        with self.lock:
            self.pins[request_id] = _Pin(list(blocks), deadline, num_tokens, block_hashes)

    def begin_read(self, request_id: str) -> list[int] | None:
        """Blocks to read, or None when the pin is gone, let go, or its lease has ended."""
        with self.lock:
            pin = self.pins.get(request_id)
            if pin is None or pin.released or time.time() > pin.deadline:
                return None
            pin.readers += 1
            return list(pin.blocks)

    def hold(self, request_id: str) -> list[int] | None:
        """Hold the pin for a multi-shard pull (its blocks); None when it cannot be read
        (as `begin_read`) or is held already."""
        with self.lock:
            pin = self.pins.get(request_id)
            now = time.time()
            if pin is None or pin.released or now > pin.deadline or now < pin.held_until:
                return None
            pin.held_until = now + self.hold_s
            return list(pin.blocks)

    def unhold(self, request_id: str) -> None:
        with self.lock:
            pin = self.pins.get(request_id)
            if pin is not None:
                pin.held_until = 0.0

    def end_read(self, request_id: str) -> None:
        with self.lock:
            pin = self.pins.get(request_id)
            if pin is not None:
                pin.readers -= 1

    def pop(self, request_id: str) -> list[int] | None:
        """Remove a pin nobody is reading; returns its blocks. None: absent, or being read
        (then it is marked released: `expired` lists it once the read ends). A hold ends
        here (its owner's release), or lapses: `hold` refuses a pin `expired` may list."""
        with self.lock:
            pin = self.pins.get(request_id)
            if pin is None:
                return None
            if pin.readers > 0:
                pin.released = True
                return None
            return self.pins.pop(request_id).blocks

    def expired(self, now: float) -> list[str]:
        """Pins to release now: nobody reads or holds them, and their lease is over or they
        were let go."""
        with self.lock:
            return [
                rid
                for rid, p in self.pins.items()
                if not p.readers and now >= p.held_until and (p.released or now > p.deadline)
            ]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.pins

    def __len__(self) -> int:
        return len(self.pins)


@dataclass
class HandoffStep:
    """What `on_step` decided: (request id, blocks to pull into) for requests whose wait
    for room ended, with None for one that will not pull (aborted meanwhile, or sent to
    recompute); the requests to queue for recompute."""

    rooms: list[tuple[str, list[int] | None]] = field(default_factory=list)
    recompute: list[Request] = field(default_factory=list)


class KVHandoff:
    """Every hand-off state of one engine (engine thread only, but `pins`)."""

    def __init__(self, kv: KVCacheManager, block_size: int, policy: LeasePolicy | None = None):
        self.kv = kv
        self.block_size = block_size
        self.policy = policy or LeasePolicy()
        self.pins = PinTable(self.policy.hold_s)  # prefill side: prompts held for a pull
        self.leases: dict[str, float] = {}  # prefills running: request id -> seconds to pin
        self.pulls: dict[str, Request] = {}  # decode side: KV arriving into reserved blocks
        self.waiting: dict[str, tuple[Request, float]] = {}  # waiting for room: (it, pin's end)
        self.num_recomputes = 0  # prompts recomputed here: no pin to wait on, or a pull failed

    # ---- the prefill side ---------------------------------------------------------------

    def expect(self, request_id: str) -> None:
        """`request_id` is a prefill: pin its blocks when it finishes (for the policy's
        `lease_s`)."""
        self.leases[request_id] = self.policy.lease_s

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """The scheduler's question at each finish: True keeps the blocks (pinned, now
        this object's), False lets the scheduler free them."""
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
        """Unpin (the pull is done, or given up); False if absent or being read (a pin
        being read goes at the next `on_step` after the read ends)."""
        blocks = self.pins.pop(request_id)
        if blocks is None:
            return False
        self.kv.release(blocks)
        return True

    # ---- the decode side ----------------------------------------------------------------

    def admit_prefilled(self, request: Request, pin_end: float | None, now: float) -> list[int] | None:
        """Blocks for a prefilled request's prompt (its first token appended; not indexed
        in the prefix cache until the data has arrived): it is then pulling. None: it waits
        for room (behind any already waiting) while its pin (`pin_end`) lasts (`waits`), or,
        with none or one about to lapse, is the caller's to recompute (counted here).
        `now`: wall-clock time (time.time()), or the simulator's."""
        if pin_end is None or not self.waiting:
            blocks = self.kv.allocate_slots(request, request.num_prompt_tokens, cache=False)
            if blocks is not None:
                self.pulls[request.request_id] = request
                return blocks
        if self.policy.may_wait(pin_end, now):
            self.waiting[request.request_id] = (request, pin_end)
        else:
            self.num_recomputes += 1
        return None

    def waits(self, request_id: str) -> bool:
        return request_id in self.waiting

    def finish_pull(self, request_id: str, ok: bool) -> Request | None:
        """The pull into the reserved blocks ended. Returns the request to run (its prompt
        computed) or to recompute (not ok: its blocks freed, counted); None when there is
        none: unknown, or aborted while its blocks were written (they are freed now)."""
        req = self.pulls.pop(request_id, None)
        if req is None:
            return None
        if req.finished:  # aborted while the pull was writing: now its blocks can go
            self.kv.free(req)
            return None
        if ok:
            req.num_computed_tokens = req.num_prompt_tokens
            self.kv.allocate_slots(req, 0)  # indexes the pulled full blocks for prefix reuse
        else:
            self.num_recomputes += 1
            self.kv.free(req)
        return req

    def abort(self, request_id: str) -> None:
        """Abort a request pulling or waiting to: a transfer may still be writing into its
        blocks, so they are freed when the pull ends (`finish_pull`), never before; one
        waiting leaves at the next `on_step`."""
        req = self.pulls.get(request_id)
        waiting = self.waiting.get(request_id)
        req = req or (waiting[0] if waiting else None)
        if req is not None:
            req.status = RequestStatus.FINISHED_ABORTED

    # ---- between steps ------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Release the pins whose lease ended, or that were let go while being read."""
        for rid in self.pins.expired(now):
            self.release(rid)

    def on_step(self, now: float, may_allocate: bool = True) -> HandoffStep:
        """Release the pins whose lease ended (or that were let go while read), then give
        the requests waiting for room their turn, in order: blocks for each that now fits
        while `may_allocate`; none for one aborted meanwhile or whose pin is about to lapse
        (that one is also returned to recompute). The first that does not fit stops the
        allocating (those behind it wait on), not the leaving."""
        self.expire(now)
        step = HandoffStep()
        for rid, (req, pin_end) in list(self.waiting.items()):
            blocks = None
            if req.finished or not self.policy.may_wait(pin_end, now):
                if not req.finished:
                    self.num_recomputes += 1
                    step.recompute.append(req)
            else:
                if may_allocate:
                    blocks = self.kv.allocate_slots(req, req.num_prompt_tokens, cache=False)
                if blocks is None:
                    may_allocate = False
                    continue
                self.pulls[rid] = req
            del self.waiting[rid]
            step.rooms.append((rid, blocks))
        return step

    # ---- what the engine reports --------------------------------------------------------

    def __contains__(self, request_id: str) -> bool:
        """Whether the id is in a hand-off here: pinned, pulling or waiting to."""
        return request_id in self.pins or request_id in self.pulls or request_id in self.waiting

    @property
    def num_pinned(self) -> int:
        return len(self.pins)

    @property
    def num_pulling(self) -> int:
        """Prompts whose KV is arriving here, or that wait for blocks to arrive in."""
        return len(self.pulls) + len(self.waiting)
