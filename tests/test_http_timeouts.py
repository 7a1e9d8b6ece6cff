"""Slow and idle HTTP clients cannot hold a connection: a request's headers and body must arrive
within their deadlines (408, then the connection is closed), idle keep-alive connections close,
and past the connection cap a request gets a 503 in OpenAI's error shape with Retry-After. Real
uvicorn on loopback, raw sockets for the stalled clients; a normal request is served throughout.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import httpx
from prometheus_client import CollectorRegistry

from shared.serving.connection_limits import ConnectionLimits
from shared.serving.metrics import AsgiServer, metrics_app
from tests.support.cluster import pd_cluster

HEADER_S, BODY_S = 1.0, 2.0
# a stalled connection must be closed by its deadline; the slack absorbs a loaded machine
SLACK_S = 8.0
LIMITS = ConnectionLimits(header_timeout=HEADER_S, body_timeout=BODY_S, keep_alive_timeout=30)
GET = b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n"


async def _closed_within(port: int, sent: bytes, limit: float) -> tuple[float, bytes]:
    """Open a connection, send `sent`, and read until the server closes it; (seconds, bytes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    try:
        writer.write(sent)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), limit)
        return time.monotonic() - start, data
    finally:
        writer.close()


async def _keep_serving(url: str, stop: asyncio.Event, method: str, path: str, **kw: object) -> int:
    """Normal requests one after another until `stop`; each must complete within 10 s."""
    served = 0
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while not stop.is_set():
            resp = await client.request(method, path, **kw)  # type: ignore[arg-type]
            assert resp.status_code == 200, resp.text
            served += 1
            await asyncio.sleep(0.05)
    return served


def _run(body: Callable[[AsgiServer], Awaitable[None]], limits: ConnectionLimits) -> None:
    async def main() -> None:
        app = metrics_app(CollectorRegistry(), lambda: True)
        server = await AsgiServer.start(app, "127.0.0.1", 0, limits=limits)
        try:
            await body(server)
        finally:
            await server.close(0.5)

    asyncio.run(main())


def test_stalled_clients_are_closed_while_others_are_served() -> None:
    async def body(server: AsgiServer) -> None:
        stalls = [b""] * 10  # connected, silent
        stalls += [b"GET /health HTTP/1.1\r\nhost: t\r\nx-slow: "] * 10  # partial headers
        post = b"POST /health HTTP/1.1\r\nhost: t\r\ncontent-length: 1000\r\n\r\n0123456789"
        stalls += [post] * 10  # full headers, 10 of 1000 body bytes
        stop = asyncio.Event()
        normal = asyncio.ensure_future(_keep_serving(server.url, stop, "GET", "/health"))
        results = await asyncio.gather(
            *(_closed_within(server.port, s, BODY_S + SLACK_S) for s in stalls)
        )
        stop.set()
        assert await normal >= 1
        for sent, (seconds, data) in zip(stalls, results, strict=True):
            deadline = BODY_S if sent == post else HEADER_S
            assert deadline * 0.9 <= seconds <= deadline + SLACK_S, (sent, seconds)
            if sent.startswith(b"GET"):  # a request had begun: it is told why
                assert data.startswith(b"HTTP/1.1 408 "), data
                error = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
                assert error["code"] == "request_timeout" and "headers" in error["message"]
            elif not sent:
                assert data == b""  # nothing began: closed without a word
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            assert (await client.get("/health")).status_code == 200

    _run(body, LIMITS)


def test_an_idle_keep_alive_connection_is_closed() -> None:
    async def body(server: AsgiServer) -> None:
        seconds, data = await _closed_within(server.port, GET, 1.0 + SLACK_S)
        assert data.startswith(b"HTTP/1.1 200 ") and seconds >= 0.9

    _run(body, ConnectionLimits(keep_alive_timeout=1.0))


def test_past_the_connection_cap_a_request_gets_503_with_retry_after() -> None:
    async def body(server: AsgiServer) -> None:
        held = []
        for _ in range(3):  # three keep-alive connections, each served once, kept open
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(GET)
            assert (await asyncio.wait_for(reader.read(17), 10)).startswith(b"HTTP/1.1 200")
            held.append(writer)
        _, data = await _closed_within(server.port, GET, 10)
        head, _, payload = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), data
        assert b"retry-after: 1" in head.lower() and b"connection: close" in head.lower()
        error = json.loads(payload)["error"]
        assert error["code"] == "too_many_connections" and error["type"]
        held.pop().close()
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            assert (await client.get("/health")).status_code == 200
        for writer in held:
            writer.close()

    _run(body, ConnectionLimits(keep_alive_timeout=30, max_connections=3))


def test_decode_node_flags_bound_a_stalled_completion_body() -> None:
    """Through the decode node's own flags: a completion whose body never completes is 408'd
    and nothing reaches the engine; other completions are served meanwhile."""

    async def main() -> None:
        overrides = {"http_port": 0, "http_header_timeout": HEADER_S, "http_body_timeout": BODY_S}
        async with pd_cluster("tiny", decode_overrides=overrides) as cluster:
            port = cluster.decodes[0].http_port
            url = f"http://127.0.0.1:{port}"
            stall = (
                b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                b'content-length: 1000\r\n\r\n{"model": "tiny", '
            )
            stop = asyncio.Event()
            completion = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
            normal = asyncio.ensure_future(
                _keep_serving(url, stop, "POST", "/v1/completions", json=completion)
            )
            results = await asyncio.gather(
                *(_closed_within(port, stall, BODY_S + SLACK_S) for _ in range(5))
            )
            stop.set()
            assert await normal >= 1
            for seconds, data in results:
                assert BODY_S * 0.9 <= seconds <= BODY_S + SLACK_S
                assert data.startswith(b"HTTP/1.1 408 "), data
                assert b"request body not received" in data
            await cluster.assert_idle_and_conserved()

    asyncio.run(main())
