"""Direct ingress's HTTP server (router/direct_http.py), without Ray: a small ASGI app
served by two servers on one port (SO_REUSEPORT), a port held by a plain listener refused
with an error naming host and port, and a graceful stop that lets a stream in flight end.
The whole app through direct ingress is tested by test_serve_cli (kvray serve) and the
colocated app of serve_fixtures.py."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvray.cluster.ports import free_port

httpx = pytest.importorskip("httpx2")  # the openai client's HTTP library
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import PlainTextResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from kvray.router.direct_http import DirectHTTP, HTTPBindError  # noqa: E402


def _app(name: str, release: asyncio.Event | None = None) -> Starlette:
    async def who(_request):
        return PlainTextResponse(name)

    async def stream(_request):
        async def parts():
            yield "first;"
            await release.wait()
            yield "last"

        return StreamingResponse(parts())

    return Starlette(routes=[Route("/who", who), Route("/stream", stream)])


async def _get(url: str) -> str:
    async with httpx.AsyncClient() as client:  # a new connection each time
        return (await client.get(url, timeout=10)).text


def test_two_servers_share_a_port_and_both_answer():
    async def main():
        port = free_port()
        servers = [DirectHTTP(_app(name), "127.0.0.1", port) for name in ("a", "b")]
        try:
            seen = set()
            for _ in range(64):  # the kernel spreads new connections over both listeners
                seen.add(await _get(f"http://127.0.0.1:{port}/who"))
                if len(seen) == 2:
                    break
            assert seen == {"a", "b"}
            assert all(s.alive for s in servers)
        finally:
            for s in servers:
                await s.stop()
        assert not any(s.alive for s in servers)

    asyncio.run(main())


def test_a_port_held_by_a_plain_listener_is_refused_by_name():
    async def main():
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            other.listen()
            port = other.getsockname()[1]
            with pytest.raises(HTTPBindError, match=f"127.0.0.1:{port}"):
                DirectHTTP(_app("a"), "127.0.0.1", port)

    asyncio.run(main())


def test_stop_lets_a_stream_in_flight_finish_and_takes_no_new_connection():
    async def main():
        release = asyncio.Event()
        port = free_port()
        server = DirectHTTP(_app("a", release), "127.0.0.1", port)
        async with httpx.AsyncClient() as client:
            async with client.stream("GET", f"http://127.0.0.1:{port}/stream", timeout=10) as r:
                chunks = r.aiter_text()
                assert await anext(chunks) == "first;"
                stopping = asyncio.ensure_future(server.stop())
                await asyncio.sleep(0.3)
                assert not stopping.done()  # waits for the stream
                with pytest.raises(httpx.ConnectError):
                    await _get(f"http://127.0.0.1:{port}/who")
                release.set()
                assert "".join([t async for t in chunks]) == "last"
            await asyncio.wait_for(stopping, 10)
        assert not server.alive

    asyncio.run(main())
