"""The workers' half of a KV hand-off: moving a prefill worker's pinned blocks into the
blocks a decode worker reserved (the engines' half, the pins, leases and pull rooms, is
engine/kv_handoff.py; both apply one `LeasePolicy`, `KVTransferConfig.lease_policy()`).

One interface a side, one implementation per `kv_transfer.connector`:

* serving pins: a source actor (a prefill worker, each shard of a sharded one) is a
  `KVServing`, its remote methods answering pulls through a `KVSource` (pack the pinned
  blocks, or a piece of given blocks, through the engine's views of them);
* pulling a job: the decode worker's `KVConnector.pull(ticket, prefill, into)` (a piece
  at a time, `pull_piece`, when either side is sharded: actors/kv_pull.py plans them).
  The decode side then confirms and the pin is released. A pull that cannot complete
  raises `KVPullError`; the decode worker then recomputes the prompt itself.

* `torch_dist`: point-to-point over a pairwise process group (gloo on CPU, NCCL on CUDA)
  built on first use through a TCPStore rendezvous. Pull requests travel on the pair's
  control group (no Ray call per pull); the blocks come as a few layer-range chunks.
* `object_store`: the packed tensor travels as a Ray object.
* `tcp` (kv_socket.py): one TCP connection per pair, received on the event loop.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import threading
import time
from abc import ABC, abstractmethod

import torch

from kvray.actors.pair_group import PairGroups, host_store, join_pair_groups
from kvray.configs import KVTransferConfig
from kvray.engine.kv_handoff import LeasePolicy
from kvray.engine.kv_transfer import KVLayout, KVTicket, layer_chunks
from kvray.engine.kv_views import BlockView, KVViews
from kvray.errors import KvrayError
from kvray.timeouts import wait_for

TAGS_PER_PULL = 4096  # header + at most one chunk per layer
REQUEST_TAG = 0  # control-group tag of pull requests
REQUEST_WORDS = 130  # int64 words of a pull request: tag, id length, up to 1 KiB of id


class KVPullError(KvrayError):
    """The blocks could not be pulled (lease ended, peer gone, transfer failed)."""


class KVSource:
    """The prefill side: packs pinned blocks for a pull (any thread; pins guard them),
    through its engine's views of one request's blocks (engine/kv_views.py).

    A shard of a multi-shard worker serves `pieces` (layers x heads of given blocks): the
    worker's driver holds the pin for the whole pull (its shards' views have no pins).
    """

    def __init__(self, views: KVViews, layout: KVLayout):
        self.views = views
        self.device = views.device
        self.layout = layout
        self.pair_groups: dict[str, PairGroups] = {}  # decode worker id -> its pair
        self.socket_server = None  # tcp connector: kv_socket.SocketServer, started on first use
        self.bytes_sent = 0

    async def export_kv(self, request_id: str) -> torch.Tensor | None:
        """object_store connector: the packed blocks, returned as a Ray object."""
        packed = await asyncio.to_thread(self._export, request_id)
        if packed is not None:
            self.bytes_sent += packed.numel() * packed.element_size()
        return packed

    def _export(self, request_id: str) -> torch.Tensor | None:
        with self.views.pinned(request_id) as blocks:  # read on one thread: a cancelled
            return None if blocks is None else blocks.pack().cpu()  # caller can't leak it

    def send_piece(self, peer_id: str, tag: int, blocks: list[int], layers: range, heads: range) -> int:
        """torch_dist, multi-shard pull: send one piece on the pair's data group (blocking)."""
        packed = self.views.of(blocks).pack(layers, heads)
        self.pair_groups[peer_id].data.send([packed], 0, tag).wait()
        sent = packed.numel() * packed.element_size()
        self.bytes_sent += sent
        return sent

    async def export_piece(self, blocks: list[int], layers: range, heads: range) -> torch.Tensor:
        """object_store, multi-shard pull: one piece as a Ray object."""
        packed = await asyncio.to_thread(lambda: self.views.of(blocks).pack(layers, heads).cpu())
        self.bytes_sent += packed.numel() * packed.element_size()
        return packed

    async def join_pair(
        self, peer_id: str, host: str, port: int, key: str, backend: str, timeout_s: float
    ) -> None:
        """torch_dist connector: build this side (rank 1) of the pair and start answering
        the peer's pull requests on a thread of its own."""
        groups = await asyncio.to_thread(join_pair_groups, None, host, port, 1, key, backend, timeout_s)
        self.pair_groups[peer_id] = groups
        timeout = datetime.timedelta(seconds=timeout_s)
        thread = threading.Thread(target=self._serve_pulls, args=(groups, timeout), daemon=True)
        thread.start()

    def _serve_pulls(self, groups: PairGroups, timeout: datetime.timedelta) -> None:
        """One pull at a time, in the order the peer asked; ends when the peer goes away."""
        message = torch.empty(REQUEST_WORDS, dtype=torch.int64)
        while True:
            try:
                groups.control.recv([message], 0, REQUEST_TAG).wait()
            except RuntimeError:  # the peer closed the pair (it stopped, died or rebuilt it)
                return
            tag, request_id = decode_request(message)
            try:
                self.bytes_sent += send_packed(groups.data, self, request_id, tag, timeout)
            except RuntimeError:  # this pull failed (the peer recomputes); serve the next
                continue


class KVServing:
    """What a KV source actor serves pulls through (mixed into the prefill worker and its
    shard actors, which set `source`, `host` and `lease`): one remote method per transport
    step, the same on every source."""

    source: KVSource
    host: str  # the address peers reach this actor's node at
    lease: LeasePolicy

    async def join_pair(self, peer_id: str, host: str, port: int, key: str, backend: str) -> None:
        """torch_dist: this side of the pair with decode worker (or shard) `peer_id`."""
        await self.source.join_pair(peer_id, host, port, key, backend, self.lease.pull_timeout_s)

    async def send_piece(self, peer_id: str, tag: int, blocks: list[int], layers: range, heads: range) -> int:
        return await asyncio.to_thread(self.source.send_piece, peer_id, tag, blocks, layers, heads)

    async def export_piece(self, blocks: list[int], layers: range, heads: range) -> torch.Tensor:
        return await self.source.export_piece(blocks, layers, heads)

    async def kv_socket_address(self) -> tuple[str, int]:
        """tcp: where this source's socket server listens (started on first use)."""
        from kvray.actors.kv_socket import socket_address  # it builds on this module's classes

        return socket_address(self.source, self.host, self.lease.pull_timeout_s)

    async def bytes_sent(self) -> int:
        return self.source.bytes_sent


class KVConnector(ABC):
    def __init__(self, worker_id: str, config: KVTransferConfig, host: str, backend: str):
        self.worker_id = worker_id
        self.lease = config.lease_policy()  # pulls end within lease.pull_timeout_s
        self.host = host
        self.backend = backend

    @abstractmethod
    async def pull(self, ticket: KVTicket, prefill, into: BlockView) -> int:
        """Copy the ticket's blocks into `into` (the blocks this engine reserved for
        them); returns bytes moved."""

    @abstractmethod
    async def pull_piece(
        self,
        source_id: str,
        source,
        src_blocks: list[int],
        src: tuple[range, range],
        into: BlockView,
        dst: tuple[range, range],
        start_by: float,
    ) -> int:
        """Multi-shard pull: copy layers x heads `src` of `src_blocks` from shard `source`
        (held by its worker's driver for the pull) into layers x heads `dst` of `into`. A
        piece that cannot start reading by `start_by` (time.time()) fails instead: the
        hold would end before a full pull timeout after it."""


class ObjectStoreConnector(KVConnector):
    async def pull(self, ticket, prefill, into):
        try:
            packed = await wait_for(prefill.export_kv.remote(ticket.request_id), self.lease.pull_timeout_s)
        except Exception as e:  # actor died, timed out
            raise KVPullError(f"object-store pull of {ticket.request_id} failed: {e!r}") from e
        if packed is None:
            raise KVPullError(f"lease of {ticket.request_id} ended before the pull")
        try:
            await asyncio.to_thread(into.unpack, packed)
        except RuntimeError as e:  # e.g. a layout that does not fit this engine's cache
            raise KVPullError(f"blocks of {ticket.request_id} do not fit here: {e}") from e
        return packed.numel() * packed.element_size()

    async def pull_piece(self, source_id, source, src_blocks, src, into, dst, start_by):
        try:
            check_start(start_by, source_id)
            packed = await wait_for(source.export_piece.remote(src_blocks, *src), self.lease.pull_timeout_s)
            await asyncio.to_thread(into.unpack, packed, *dst)
        except KVPullError:
            raise
        except Exception as e:  # actor died, timed out, shapes do not fit
            raise KVPullError(f"object-store piece from {source_id} failed: {e!r}") from e
        return packed.numel() * packed.element_size()


class PeerLinks:
    """A connector's links to its peers (a pair of groups, a socket), each built on first
    use. Pulls that come while one is built wait for that one build; after a build failed
    (a peer that cannot be reached), pulls from that peer fail at once, and so recompute,
    for `retry_after_s` before it is tried again: no pull queues behind builds that time
    out. One transfer at a time per peer (`lock`): the prefill side serves a peer's pulls
    in order anyway, and NCCL matches messages by order, not by tag."""

    def __init__(self, build, retry_after_s: float):
        self.build = build  # async (peer_id, peer) -> link
        self.retry_after_s = retry_after_s
        self.links: dict[str, object] = {}
        self.building: dict[str, asyncio.Future] = {}  # peer id -> its link, being built
        self.failed: dict[str, tuple[float, str]] = {}  # peer id -> (no new try before, why)
        self.locks: dict[str, asyncio.Lock] = {}

    def lock(self, peer_id: str) -> asyncio.Lock:
        return self.locks.setdefault(peer_id, asyncio.Lock())

    async def get(self, peer_id: str, peer):
        if peer_id in self.links:
            return self.links[peer_id]
        retry_at, why = self.failed.get(peer_id, (0.0, ""))
        if time.monotonic() < retry_at:
            raise KVPullError(
                f"no link to {peer_id} (tried again in {retry_at - time.monotonic():.0f} s): {why}"
            )
        build = self.building.get(peer_id)
        if build is None:
            build = self.building[peer_id] = asyncio.ensure_future(self._build(peer_id, peer))
        return await asyncio.shield(build)  # a cancelled pull leaves the build to the others

    async def _build(self, peer_id: str, peer):
        try:
            link = await self.build(peer_id, peer)
        except Exception as e:
            self.failed[peer_id] = (time.monotonic() + self.retry_after_s, repr(e))
            raise
        finally:
            self.building.pop(peer_id, None)
        self.failed.pop(peer_id, None)
        self.links[peer_id] = link
        return link

    def drop(self, peer_id: str, close=None) -> None:
        """Forget the link (a failed transfer leaves it out of step); the next pull builds
        a new one. `close` is called if the dropped link is still the current one."""
        if peer_id in self.links:
            self.links.pop(peer_id)
            if close is not None:
                close()


class TorchDistConnector(KVConnector):
    def __init__(self, *args):
        super().__init__(*args)
        self.links = PeerLinks(self._build, self.lease.pull_timeout_s)
        self.stores: dict[str, object] = {}  # kept alive: the pair's rendezvous
        # a pull uses tags tag .. tag + chunks; gloo tags must stay below 2**31
        self.tags = itertools.cycle(range(1, 2**31 - TAGS_PER_PULL, TAGS_PER_PULL))

    @property
    def groups(self) -> dict[str, PairGroups]:
        return self.links.links

    async def _build(self, peer_id: str, peer) -> PairGroups:
        """The pair with `peer` (this side hosts the store)."""
        timeout = self.lease.pull_timeout_s
        store = host_store(self.host, timeout)
        key = f"kvray/{self.worker_id}/{peer_id}"
        joined = peer.join_pair.remote(self.worker_id, self.host, store.port, key, self.backend)
        groups = await asyncio.to_thread(
            join_pair_groups, store, self.host, store.port, 0, key, self.backend, timeout
        )
        await wait_for(joined, timeout)
        self.stores[peer_id] = store
        return groups

    def _forget(self, peer_id: str) -> None:
        """A gloo timeout closes the pair: forget it, the next pull builds a new one."""
        self.links.drop(peer_id)
        self.stores.pop(peer_id, None)

    async def pull(self, ticket, prefill, into):
        """Ask on the control group, then receive on the data group: the sender answers
        with a one-element header (1: the blocks follow, 0: the pin is gone), so a late
        pull never waits for data; the blocks then come as layer-range chunks, all
        receives posted at once, each chunk unpacked while the next ones arrive."""
        peer_id = ticket.worker_id
        try:
            groups = await self.links.get(peer_id, prefill)
            tag = next(self.tags)
            request = encode_request(tag, ticket.request_id)
            timeout = datetime.timedelta(seconds=self.lease.pull_timeout_s)

            def transfer() -> int:
                groups.control.send([request], 1, REQUEST_TAG).wait(timeout)
                return receive_packed(groups.data, ticket, into, tag, timeout)

            async with self.links.lock(peer_id):
                moved = await asyncio.to_thread(transfer)
        except Exception as e:  # peer died mid-transfer, gloo timeout, ...
            self._forget(peer_id)
            raise KVPullError(f"torch_dist pull of {ticket.request_id} failed: {e!r}") from e
        if moved == 0:
            raise KVPullError(f"lease of {ticket.request_id} ended before the pull")
        return moved

    async def pull_piece(self, source_id, source, src_blocks, src, into, dst, start_by):
        """The source is told by a Ray call to send; the piece comes on the pair's data group."""
        buf = into.empty_piece(*dst)
        timeout = datetime.timedelta(seconds=self.lease.pull_timeout_s)
        try:
            groups = await self.links.get(source_id, source)
            tag = next(self.tags)
            async with self.links.lock(source_id):
                check_start(start_by, source_id)
                sent = source.send_piece.remote(self.worker_id, tag, src_blocks, *src)
                await asyncio.to_thread(lambda: groups.data.recv([buf], 1, tag).wait(timeout))
                await sent
            await asyncio.to_thread(into.unpack, buf, *dst)
        except KVPullError:
            raise
        except Exception as e:  # peer died mid-transfer, gloo timeout, ...
            self._forget(source_id)
            raise KVPullError(f"torch_dist piece from {source_id} failed: {e!r}") from e
        return buf.numel() * buf.element_size()


def check_start(start_by: float, source_id: str) -> None:
    if time.time() > start_by:
        raise KVPullError(f"piece from {source_id} queued past its hold; recomputing")


def encode_request(tag: int, request_id: str) -> torch.Tensor:
    """[tag, id length, id bytes in 8-byte words...]: one control message per pull."""
    raw = request_id.encode()
    if len(raw) > 8 * (REQUEST_WORDS - 2):
        raise KVPullError(f"request id longer than {8 * (REQUEST_WORDS - 2)} bytes")
    words = torch.zeros(REQUEST_WORDS, dtype=torch.int64)
    words[0], words[1] = tag, len(raw)
    padded = raw + b"\0" * (-len(raw) % 8)
    if padded:
        words[2 : 2 + len(padded) // 8] = torch.frombuffer(bytearray(padded), dtype=torch.int64)
    return words


def decode_request(words: torch.Tensor) -> tuple[int, str]:
    tag, length = int(words[0]), int(words[1])
    return tag, words[2:].numpy().tobytes()[:length].decode()


def receive_packed(pg, ticket: KVTicket, into: BlockView, tag: int, timeout: datetime.timedelta) -> int:
    """The decode side of a torch_dist pull (blocking; run it in a thread). Every receive
    waits at most `timeout` (the pull timeout), on NCCL as on gloo."""
    layout = ticket.layout
    device = into.device
    header = torch.zeros(1, dtype=torch.int64, device=device)
    pg.recv([header], 1, tag).wait(timeout)
    if int(header.item()) == 0:
        return 0
    n = len(ticket.block_ids)
    chunks = layer_chunks(layout, n)
    shape = layout.packed_shape(n)[1:]
    bufs = [torch.empty((len(c), *shape), dtype=layout.torch_dtype, device=device) for c in chunks]
    works = [pg.recv([buf], 1, tag + 1 + i) for i, buf in enumerate(bufs)]
    for layers, buf, work in zip(chunks, bufs, works):
        work.wait(timeout)
        into.unpack(buf, layers)
    return sum(b.numel() * b.element_size() for b in bufs)


def send_packed(pg, source: KVSource, request_id: str, tag: int, timeout: datetime.timedelta) -> int:
    """The prefill side of a torch_dist pull (blocking): header, then packed chunks, each
    packed while the previous one is on the wire; every send waits at most `timeout`."""
    with source.views.pinned(request_id) as blocks:
        if blocks is None:
            pg.send([torch.zeros(1, dtype=torch.int64, device=source.device)], 0, tag).wait(timeout)
            return 0
        sent, works = 0, []
        pg.send([torch.ones(1, dtype=torch.int64, device=source.device)], 0, tag).wait(timeout)
        for i, layers in enumerate(layer_chunks(source.layout, len(blocks))):
            packed = blocks.pack(layers)
            works.append(pg.send([packed], 0, tag + 1 + i))
            sent += packed.numel() * packed.element_size()
        for work in works:
            work.wait(timeout)
    return sent


CONNECTOR_NAMES = ("torch_dist", "object_store", "tcp")


def connector_class(name: str) -> type[KVConnector]:
    """The connector `kv_transfer.connector` names."""
    from kvray.actors.kv_socket import SocketConnector  # it builds on this module's classes

    classes = {"torch_dist": TorchDistConnector, "object_store": ObjectStoreConnector, "tcp": SocketConnector}
    return classes[name]
