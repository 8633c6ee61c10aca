"""The `tcp` KV connector (actors/kv_socket.py) between two caches in this process, over
real loopback sockets: the pulled blocks equal the source's, byte for byte (fp32 and bf16,
whole pulls and layer x head pieces), a lease that ended is a KVPullError, and a peer that
drops the connection or stops reading fails the pull (and lets its pin go) within the pull
timeout, after which the next pull works on a new connection. Ray calls are stood in for
by objects with the same `.remote()` shape."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

from kvray.actors.kv_socket import COUNT, LENGTH, SocketConnector, socket_address
from kvray.actors.kv_transport import KVPullError, KVSource
from kvray.configs import KVTransferConfig
from kvray.engine.kv_handoff import PinTable
from kvray.engine.kv_transfer import KVLayout, KVTicket
from kvray.engine.kv_views import BlockView, KVViews

HOST = "127.0.0.1"


class Peer:
    """A prefill worker as the connector sees it: `kv_socket_address.remote()`."""

    def __init__(self, source: KVSource, timeout_s: float = 5.0):
        outer = self

        class kv_socket_address:  # noqa: N801 (the shape of a Ray actor method)
            @staticmethod
            async def remote():
                return outer.address

        self.kv_socket_address = kv_socket_address
        self.address = socket_address(source, HOST, timeout_s)


class Source(KVSource):
    """A source with the test's handles on what its engine keeps: the cache and the pins."""

    def __init__(self, layout: KVLayout, num_blocks: int, seed: int = 0):
        torch.manual_seed(seed)
        self.cache = torch.randn(layout.packed_shape(num_blocks)).to(layout.torch_dtype)
        self.pins = PinTable()
        super().__init__(KVViews(self.cache, self.pins), layout)


def make_source(layout: KVLayout, num_blocks: int, seed: int = 0) -> Source:
    return Source(layout, num_blocks, seed)


def into(cache: torch.Tensor, blocks: list[int]) -> BlockView:
    """The decode side's reserved blocks of its cache"""
    return KVViews(cache).of(blocks)


def pin(source: KVSource, request_id: str, blocks: list[int]) -> KVTicket:
    n = len(blocks) * source.layout.block_size
    source.pins.add(request_id, blocks, time.time() + 60, n, ())
    return KVTicket("src", request_id, tuple(blocks), n, (), source.layout, time.time() + 60)


def pair(layout: KVLayout, num_blocks: int, timeout_s: float):
    """(source, its peer, a decode-side connector, a zeroed destination cache of num_blocks)."""
    source = make_source(layout, num_blocks)
    connector = SocketConnector("dst", KVTransferConfig(pull_timeout_seconds=timeout_s), HOST, "gloo")
    return source, Peer(source), connector, torch.zeros(layout.packed_shape(num_blocks))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pull_copies_the_pinned_blocks_exactly_and_counts_the_bytes(dtype):
    layout = KVLayout(30, 16, 3, 64, dtype)  # SmolLM2's: 40 blocks span several layer chunks
    source = make_source(layout, 100)
    src_blocks = list(range(1, 80, 2))
    ticket = pin(source, "r1", src_blocks)
    dst_cache = torch.zeros(layout.packed_shape(60), dtype=layout.torch_dtype)
    dst_blocks = list(range(59, 19, -1))
    connector = SocketConnector("dst", KVTransferConfig(pull_timeout_seconds=5), HOST, "gloo")

    moved = asyncio.run(connector.pull(ticket, Peer(source), into(dst_cache, dst_blocks)))

    assert moved == layout.packed_bytes(len(src_blocks)) == source.bytes_sent
    assert torch.equal(dst_cache[:, :, dst_blocks], source.cache[:, :, src_blocks])
    untouched = [b for b in range(60) if b not in dst_blocks]
    assert not dst_cache[:, :, untouched].any()
    assert source.pins.pins["r1"].readers == 0  # the read ended with the pull


def test_pieces_move_given_layers_and_heads_and_a_gone_lease_is_a_pull_error():
    layout = KVLayout(4, 16, 4, 8, "float32")
    source, peer, connector, dst = pair(layout, 10, timeout_s=5)

    async def scenario():
        # layers 1-2, heads 2-3 of source blocks [3, 7] into layers 0-1, heads 0-1 of [5, 6]
        moved = await connector.pull_piece(
            "src", peer, [3, 7], (range(1, 3), range(2, 4)), into(dst, [5, 6]), (range(0, 2), range(0, 2)),
            time.time() + 60,
        )  # fmt: skip
        assert moved == 2 * 2 * 2 * 16 * 2 * 8 * 4
        assert torch.equal(dst[0:2, :, [5, 6], :, 0:2], source.cache[1:3, :, [3, 7], :, 2:4])
        assert dst.count_nonzero() == dst[0:2, :, [5, 6], :, 0:2].count_nonzero()
        ticket = pin(source, "late", [1, 2])
        source.pins.pop("late")  # the lease ended before the pull
        with pytest.raises(KVPullError, match="lease of late ended"):
            await connector.pull(ticket, peer, into(dst, [0, 1]))
        ticket = pin(source, "on-time", [1, 2])  # the same connection serves the next pull
        assert await connector.pull(ticket, peer, into(dst, [0, 1])) == layout.packed_bytes(2)
        assert len(connector.links.links) == 1

    asyncio.run(scenario())


def test_a_peer_that_drops_the_connection_fails_the_pull_and_the_next_pull_reconnects():
    layout = KVLayout(2, 16, 1, 8, "float32")
    source, peer, connector, dst = pair(layout, 4, timeout_s=2)

    class Dropper:  # accepts, reads the request, closes without answering
        def __init__(self):
            self.listener = socket.create_server((HOST, 0))
            self.listener.setblocking(False)

        async def serve_once(self):
            conn, _ = await asyncio.get_running_loop().sock_accept(self.listener)
            await asyncio.get_running_loop().sock_recv(conn, 1024)
            conn.close()

    dropper = Dropper()

    async def scenario():
        real = peer.address
        peer.address = dropper.listener.getsockname()
        serving = asyncio.ensure_future(dropper.serve_once())
        started = time.monotonic()
        with pytest.raises(KVPullError, match="tcp pull of r1 failed"):
            await connector.pull(pin(source, "r1", [0, 1]), peer, into(dst, [2, 3]))
        assert time.monotonic() - started < 2.0  # closed: fails at once, not at the timeout
        await serving
        assert connector.links.links == {}  # the broken connection is forgotten
        peer.address = real
        assert await connector.pull(
            pin(source, "r2", [0, 1]), peer, into(dst, [2, 3])
        ) == layout.packed_bytes(2)
        assert torch.equal(dst[:, :, [2, 3]], source.cache[:, :, [0, 1]])

    asyncio.run(scenario())
    dropper.listener.close()


def test_a_decode_side_that_stops_reading_releases_the_pin_after_the_timeout():
    layout = KVLayout(32, 16, 8, 128, "float32")  # 64 blocks: 128 MiB, far more than socket buffers
    source = make_source(layout, 64)
    pin(source, "big", list(range(64)))
    host, port = socket_address(source, HOST, 0.5)
    with socket.create_connection((host, port)) as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        body = b'{"id": "big"}'
        conn.sendall(LENGTH.pack(len(body)) + body)
        assert COUNT.unpack(conn.recv(COUNT.size, socket.MSG_WAITALL)) == (layout.packed_bytes(64),)
        deadline = time.monotonic() + 10
        while source.pins.pins["big"].readers and time.monotonic() < deadline:
            time.sleep(0.05)  # never read: the sender's send times out after 0.5 s
        assert source.pins.pins["big"].readers == 0
        assert source.pins.pop("big") == list(range(64))  # nothing holds the blocks any more
