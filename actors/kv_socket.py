"""The `tcp` KV connector: blocks over one plain TCP connection per worker pair.

A gloo pull hands off to a thread on each side (gloo's receives cannot complete on an
event loop), and each hand-off can wait for a core; on a fast link those waits are most of
a small pull. Here the decode side's receive runs on its worker's event loop: the request
goes out and the packed chunks land in their buffers straight from the socket
(`loop.sock_recv_into`), each chunk unpacked into the cache as it completes, with no
thread in between. The prefill side answers on a thread per connection with blocking
sends, packing the next chunk while the last one is on the wire.

Wire format, both ways little-endian. A request: u32 length, then that many bytes of JSON:
`{"id": request_id}` (a whole pull of a pinned ticket) or `{"blocks": [...], "layers":
[start, stop], "heads": [start, stop]}` (a piece of a multi-shard pull; the prefill
worker's driver holds the pin). The answer: i64 byte count (0: the pin is gone), then the
packed bytes, layer chunk after layer chunk (`layer_chunks`, as torch_dist sends them).
A connection that fails or times out mid-pull is closed (the stream is out of step) and
the next pull opens a new one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import threading

import torch

from kvray.actors.kv_transport import KVConnector, KVPullError, KVSource, PeerLinks, check_start
from kvray.engine.kv_transfer import layer_chunks
from kvray.timeouts import wait_for

logger = logging.getLogger(__name__)

LENGTH = struct.Struct("<I")  # a request's JSON length
COUNT = struct.Struct("<q")  # an answer's byte count
MAX_REQUEST_BYTES = 1 << 20
# Wake the loop only when this much of a chunk has arrived (SO_RCVLOWAT): far fewer loop
# iterations per pull than one per segment burst; the kernel grows the receive buffer to fit.
WAKE_BYTES = 256 << 10


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable (any dtype, bf16 included)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def encode_request(request: dict) -> bytes:
    body = json.dumps(request).encode()
    return LENGTH.pack(len(body)) + body


class SocketServer:
    """The prefill side: listens on the node's address; a thread per connection answers
    its requests in order from `source`."""

    def __init__(self, source: KVSource, host: str, timeout_s: float):
        self.source = source
        self.timeout_s = timeout_s
        self.listener = socket.create_server((host, 0))
        self.address = (host, self.listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Requests until the peer closes; a send that stalls past the pull timeout (a peer
        that stopped reading) ends the connection and lets the pin go."""
        with conn:
            while True:
                try:
                    conn.settimeout(None)  # between pulls: wait as long as the peer likes
                    request = self._read_request(conn)
                    if request is None:
                        return
                    conn.settimeout(self.timeout_s)
                    self.source.bytes_sent += self._answer(conn, request)
                except (OSError, ValueError) as e:  # peer gone, stalled, or a bad request
                    logger.info("kvray: KV connection closed: %r", e)
                    return

    def _read_request(self, conn: socket.socket) -> dict | None:
        head = _recv_exactly(conn, LENGTH.size)
        if head is None:
            return None
        (length,) = LENGTH.unpack(head)
        if length > MAX_REQUEST_BYTES:
            raise ValueError(f"request of {length} bytes")
        body = _recv_exactly(conn, length)
        if body is None:
            return None
        return json.loads(body)

    def _answer(self, conn: socket.socket, request: dict) -> int:
        source = self.source
        if "id" not in request:  # a piece: the pin is held by the worker's driver
            layers, heads = range(*request["layers"]), range(*request["heads"])
            data = source.views.of(request["blocks"]).pack(layers, heads).cpu()
            conn.sendall(COUNT.pack(data.numel() * data.element_size()))
            conn.sendall(byte_view(data))
            return data.numel() * data.element_size()
        with source.views.pinned(request["id"]) as blocks:
            if blocks is None:
                conn.sendall(COUNT.pack(0))
                return 0
            conn.sendall(COUNT.pack(source.layout.packed_bytes(len(blocks))))
            sent = 0
            for layers in layer_chunks(source.layout, len(blocks)):
                data = blocks.pack(layers).cpu()
                conn.sendall(byte_view(data))
                sent += data.numel() * data.element_size()
            return sent

    def close(self) -> None:
        self.listener.close()


def socket_address(source: KVSource, host: str, timeout_s: float) -> tuple[str, int]:
    """Where the tcp connector reaches `source` (its server starts on the first ask)."""
    if source.socket_server is None:
        source.socket_server = SocketServer(source, host, timeout_s)
    return source.socket_server.address


def _recv_exactly(conn: socket.socket, n: int) -> bytes | None:
    """n bytes from a blocking socket; None if the peer closed before the first byte."""
    data = bytearray()
    while len(data) < n:
        got = conn.recv(n - len(data))
        if not got:
            if data:
                raise OSError("connection closed mid-message")
            return None
        data += got
    return bytes(data)


async def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from a non-blocking socket on the running loop."""
    loop = asyncio.get_running_loop()
    got = 0
    while got < len(view):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, min(len(view) - got, WAKE_BYTES))
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ConnectionError("the prefill worker closed the connection")
        got += n


class SocketConnector(KVConnector):
    """The decode side: one connection per peer, opened on first use (the peer's
    `kv_socket_address()` says where), one pull at a time on it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.links = PeerLinks(self._connect, self.lease.pull_timeout_s)

    async def _connect(self, peer_id: str, peer) -> socket.socket:
        timeout = self.lease.pull_timeout_s
        host, port = await wait_for(peer.kv_socket_address.remote(), timeout)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), timeout)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _exchange(self, peer_id: str, peer, request: dict, receive) -> int:
        """Send `request` on the peer's connection and run `receive(sock, count)`; any
        failure or cancel mid-way closes the connection (the stream is out of step)."""
        timeout = self.lease.pull_timeout_s
        async with self.links.lock(peer_id):
            sock = await self.links.get(peer_id, peer)
            try:
                return await wait_for(self._roundtrip(sock, request, receive), timeout)
            except BaseException:
                self.links.drop(peer_id, sock.close)
                raise

    @staticmethod
    async def _roundtrip(sock: socket.socket, request: dict, receive) -> int:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, encode_request(request))
        count = bytearray(COUNT.size)
        await recv_into(sock, memoryview(count))
        (nbytes,) = COUNT.unpack(count)
        return 0 if nbytes == 0 else await receive(sock, nbytes)

    async def pull(self, ticket, prefill, into):
        layout = ticket.layout
        n = len(ticket.block_ids)
        chunks = layer_chunks(layout, n)
        shape = layout.packed_shape(n)[1:]

        async def receive(sock: socket.socket, nbytes: int) -> int:
            if nbytes != layout.packed_bytes(n):
                raise KVPullError(f"{nbytes} bytes offered for {layout.packed_bytes(n)} expected")
            for layers in chunks:
                buf = torch.empty((len(layers), *shape), dtype=layout.torch_dtype)
                await recv_into(sock, byte_view(buf))
                into.unpack(buf, layers)
            return nbytes

        try:
            moved = await self._exchange(ticket.worker_id, prefill, {"id": ticket.request_id}, receive)
        except KVPullError:
            raise
        except Exception as e:  # peer gone, timed out, refused
            raise KVPullError(f"tcp pull of {ticket.request_id} failed: {e!r}") from e
        if moved == 0:
            raise KVPullError(f"lease of {ticket.request_id} ended before the pull")
        return moved

    async def pull_piece(self, source_id, source, src_blocks, src, into, dst, start_by):
        layers, heads = dst
        buf = into.empty_piece(layers, heads, "cpu")  # staged through host memory
        (src_layers, src_heads) = src
        request = {
            "blocks": list(src_blocks),
            "layers": [src_layers.start, src_layers.stop],
            "heads": [src_heads.start, src_heads.stop],
        }

        async def receive(sock: socket.socket, nbytes: int) -> int:
            if nbytes != buf.numel() * buf.element_size():
                raise KVPullError(f"{nbytes} bytes offered for a piece of {buf.numel() * buf.element_size()}")
            await recv_into(sock, byte_view(buf))
            into.unpack(buf, layers, heads)
            return nbytes

        try:
            check_start(start_by, source_id)
            return await self._exchange(source_id, source, request, receive)
        except KVPullError:
            raise
        except Exception as e:
            raise KVPullError(f"tcp piece from {source_id} failed: {e!r}") from e
