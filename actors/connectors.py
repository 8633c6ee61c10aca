"""KV connectors: how a decode worker pulls a prefill worker's pinned blocks.

Both connectors share one shape. The decode side calls `pull(ticket, prefill, ...)`; the
prefill side answers through its worker's `KVSource` (pack the pinned blocks into one
tensor, hand it over, unpin when the decode side confirms). A pull that cannot complete
raises `KVPullError`; the decode worker then recomputes the prompt itself.

* `torch_dist`: point-to-point over a pairwise process group (gloo on CPU, NCCL on CUDA)
  built on first use through a TCPStore rendezvous; one packed message per pull.
* `object_store`: the packed tensor travels as a Ray object.
"""

from __future__ import annotations

import asyncio
import itertools
from abc import ABC, abstractmethod

import torch

from kvray.actors.pair_group import host_store, join_group
from kvray.configs import KVTransferConfig
from kvray.engine.kv_transfer import KVTicket, PinTable, pack_blocks, unpack_blocks
from kvray.errors import KvrayError


class KVPullError(KvrayError):
    """The blocks could not be pulled (lease ended, peer gone, transfer failed)."""


class KVSource:
    """The prefill side: packs pinned blocks for a pull (any thread; pins guard them)."""

    def __init__(self, pins: PinTable, kv_caches: list, device: torch.device):
        self.pins = pins
        self.kv_caches = kv_caches
        self.device = device
        self.pair_groups: dict[str, object] = {}  # decode worker id -> pair group
        self.bytes_sent = 0

    def begin(self, request_id: str) -> list[int] | None:
        return self.pins.begin_read(request_id)

    def pack(self, request_id: str, blocks: list[int]) -> torch.Tensor:
        try:
            return pack_blocks(self.kv_caches, blocks)
        finally:
            self.pins.end_read(request_id)

    # The worker's actor methods of the same names delegate here.

    async def export_kv(self, request_id: str) -> torch.Tensor | None:
        """object_store connector: the packed blocks, returned as a Ray object."""
        blocks = self.begin(request_id)
        if blocks is None:
            return None
        packed = await asyncio.to_thread(self.pack, request_id, blocks)
        self.bytes_sent += packed.numel() * packed.element_size()
        return packed.cpu()

    async def join_pair(self, peer_id: str, host: str, port: int, key: str, backend: str,
                        timeout_s: float) -> None:
        """torch_dist connector: build this side (rank 1) of the pair group."""
        self.pair_groups[peer_id] = await asyncio.to_thread(
            join_group, None, host, port, 1, key, backend, timeout_s
        )

    async def send_kv(self, request_id: str, peer_id: str, tag: int) -> int:
        sent = await asyncio.to_thread(send_packed, self.pair_groups[peer_id], self, request_id, tag,
                                       self.device)
        self.bytes_sent += sent
        return sent


class KVConnector(ABC):
    def __init__(self, worker_id: str, config: KVTransferConfig, host: str, backend: str):
        self.worker_id = worker_id
        self.config = config
        self.host = host
        self.backend = backend

    @abstractmethod
    async def pull(self, ticket: KVTicket, prefill, kv_caches, dst_blocks: list[int]) -> int:
        """Copy the ticket's blocks into `dst_blocks` of `kv_caches`; returns bytes moved."""


class ObjectStoreConnector(KVConnector):
    async def pull(self, ticket, prefill, kv_caches, dst_blocks):
        try:
            packed = await asyncio.wait_for(prefill.export_kv.remote(ticket.request_id),
                                            self.config.pull_timeout_seconds)
        except Exception as e:  # actor died, timed out
            raise KVPullError(f"object-store pull of {ticket.request_id} failed: {e!r}") from e
        if packed is None:
            raise KVPullError(f"lease of {ticket.request_id} ended before the pull")
        await asyncio.to_thread(unpack_blocks, kv_caches, dst_blocks, packed)
        return packed.numel() * packed.element_size()


class TorchDistConnector(KVConnector):
    def __init__(self, *args):
        super().__init__(*args)
        self.groups: dict[str, object] = {}
        self.stores: dict[str, object] = {}
        self.tags = itertools.count(1, 2)  # each pull uses tag and tag + 1
        self.lock = asyncio.Lock()

    async def group(self, peer_id: str, peer):
        """The pair group with `peer`, built on first use (this side hosts the store)."""
        async with self.lock:
            if peer_id not in self.groups:
                timeout = self.config.pull_timeout_seconds
                store = host_store(self.host, timeout)
                key = f"kvray/{self.worker_id}/{peer_id}"
                joined = peer.join_pair.remote(self.worker_id, self.host, store.port, key, self.backend)
                self.groups[peer_id] = await asyncio.to_thread(
                    join_group, store, self.host, store.port, 0, key, self.backend, timeout
                )
                self.stores[peer_id] = store
                await joined
            return self.groups[peer_id]

    async def pull(self, ticket, prefill, kv_caches, dst_blocks):
        """The sender first sends a one-element header (1: the packed blocks follow, 0: the
        pin is gone), so a late pull never leaves this side waiting for data."""
        try:
            pg = await self.group(ticket.worker_id, prefill)
            layout = ticket.layout
            device = kv_caches[0][0].device
            header = torch.zeros(1, dtype=torch.int64, device=device)
            buf = torch.empty(layout.packed_shape(len(ticket.block_ids)), dtype=layout.torch_dtype, device=device)
            tag = next(self.tags)
            sent = prefill.send_kv.remote(ticket.request_id, self.worker_id, tag)

            def receive() -> bool:
                pg.recv([header], 1, tag).wait()
                if int(header.item()) == 0:
                    return False
                pg.recv([buf], 1, tag + 1).wait()
                return True

            received = await asyncio.to_thread(receive)
            await sent
        except Exception as e:  # peer died mid-transfer, gloo timeout, ...
            raise KVPullError(f"torch_dist pull of {ticket.request_id} failed: {e!r}") from e
        if not received:
            raise KVPullError(f"lease of {ticket.request_id} ended before the pull")
        await asyncio.to_thread(unpack_blocks, kv_caches, dst_blocks, buf)
        return buf.numel() * buf.element_size()


def send_packed(pg, source: KVSource, request_id: str, tag: int, device) -> int:
    """The prefill side of a torch_dist pull (blocking; run it in a thread)."""
    blocks = source.begin(request_id)
    header = torch.tensor([0 if blocks is None else 1], dtype=torch.int64, device=device)
    pg.send([header], 0, tag).wait()
    if blocks is None:
        return 0
    packed = source.pack(request_id, blocks)
    pg.send([packed], 0, tag + 1).wait()
    return packed.numel() * packed.element_size()


CONNECTORS: dict[str, type[KVConnector]] = {
    "torch_dist": TorchDistConnector,
    "object_store": ObjectStoreConnector,
}
