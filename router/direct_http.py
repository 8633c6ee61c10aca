"""Direct ingress: an ingress replica serves HTTP itself, on its own event loop.

Through Serve's proxy every streamed chunk is one Ray object from the replica to the proxy
process, and both sides pay Ray's per-object cost (about 0.3 ms of CPU each on a 2-core
machine: more than the rest of the plane per token together). Served here, a chunk is one
write to the client's socket from the loop that produced it.

Several replicas on one node share the port through SO_REUSEPORT (the kernel spreads new
connections over them), so the app keeps one URL per node without a proxy or HAProxy in
front: Ray Serve's "direct ingress" (`RAY_SERVE_ENABLE_DIRECT_INGRESS`) gives each replica
a port of its own instead. What the replica serves is the same FastAPI app that Serve's
proxy would reach; requests bypass Serve's per-request accounting, and the ingress does
its own admission (`max_queued_requests`) and deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from kvray.errors import KvrayError

logger = logging.getLogger(__name__)
KEEP_ALIVE_S = 90  # as Serve's proxy: clients' pools keep their connections between requests


class HTTPBindError(KvrayError):
    """The replica could not listen on the configured host and port."""


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the Ray worker owns its process's signals


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that other replicas of this node may share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise HTTPBindError(f"direct ingress cannot listen on {host}:{port}: {e}") from None
    sock.setblocking(False)
    return sock


class DirectHTTP:
    """`app` served on `host:port` from the running event loop until `stop()`."""

    def __init__(self, app, host: str, port: int, graceful_shutdown_s: float = 20.0):
        self.host, self.port = host, port
        self.socket = listen(host, port)  # fails here, in the replica's constructor
        config = uvicorn.Config(
            app,
            lifespan="off",
            access_log=False,
            log_config=None,
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=graceful_shutdown_s,
        )
        self.server = _Server(config)
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.socket]))
        self.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.error("kvray ingress: HTTP server on %s:%d failed: %r", self.host, self.port, error)

    @property
    def alive(self) -> bool:
        return not self.task.done()

    async def stop(self) -> None:
        """Stop accepting, let the requests in flight finish (up to the grace period)."""
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self.task
        self.socket.close()
