"""What one HTTP connection may hold: deadlines for a request's headers and body, the idle
keep-alive timeout, and a cap on open connections, enforced in uvicorn's httptools protocol.

uvicorn has no read timeout of its own: its keep-alive timer runs only between requests (armed
after a response), so a client that connects and sends nothing, or part of its headers, or fewer
body bytes than its Content-Length, holds the connection (an fd, a parser, a task) for ever. The
deadlines live in a protocol subclass because only the protocol sees a connection before its
headers are complete; an ASGI middleware starts after that and could bound only the body.

    limits = ConnectionLimits(header_timeout=5, body_timeout=30)
    uvicorn.Config(app, **limits.uvicorn_options())

A request that misses its deadline is answered 408 (when it has begun and nothing was answered
yet) and its connection closed; a connection that never sent a byte is closed silently. Past
`max_connections` open connections a request is answered 503 with Retry-After, in OpenAI's
error shape, and its connection closed (uvicorn's own limit_concurrency answers a bare text 503
without Retry-After and without reading the body, which can reset the connection under the
client's feet).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from shared.serving.limits import (
    HTTP_BODY_TIMEOUT_S,
    HTTP_HEADER_TIMEOUT_S,
    HTTP_KEEP_ALIVE_S,
    HTTP_MAX_CONNECTIONS,
)

# a refused request's body is read (and dropped) up to this much before the answer, so that a
# client still sending gets to read it instead of a connection reset
REFUSAL_DRAIN_BYTES = 1024 * 1024
RETRY_AFTER_SECONDS = "1"


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = HTTP_HEADER_TIMEOUT_S
    body_timeout: float = HTTP_BODY_TIMEOUT_S
    keep_alive_timeout: float = HTTP_KEEP_ALIVE_S
    max_connections: int = HTTP_MAX_CONNECTIONS

    def validate(self) -> None:
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"http_{name} must be positive, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"http_max_connections must be >= 1, got {self.max_connections}")

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn.Config's keywords: our protocol; no limit_concurrency (the protocol caps)."""
        protocol = type("LimitedHttpProtocol", (LimitedHttpProtocol,), {"limits": self})
        return {"http": protocol, "timeout_keep_alive": self.keep_alive_timeout}


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with per-request read deadlines and a connection cap.

    One timer per connection: armed for the headers when the connection opens and when a
    request's first byte arrives, re-armed for the body when the headers are complete,
    cancelled when the request is complete. While this server is still answering an earlier
    request on the connection (pipelining), reading is paused and the timer waits its turn.
    """

    limits: ClassVar[ConnectionLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._began = False  # some bytes of a request arrived
        self._inner_app = self.app
        self.app = self._admit  # every request passes the connection cap first

    # ---- the deadline ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout, "headers")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._began = True
        self._arm(self.limits.header_timeout, "headers")

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self.limits.body_timeout, "body")

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._began = False
        self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float, stage: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expired, seconds, stage)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _busy(self, stage: str) -> bool:
        """This server, not the client, is what the request waits on."""
        if stage == "body":
            return bool(self.pipeline)  # queued behind an earlier answer, reading paused
        return self.cycle is not None and not self.cycle.response_complete

    def _expired(self, seconds: float, stage: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._busy(stage):
            self._arm(seconds, stage)
            return
        cycle = self.cycle if stage == "body" else None
        answer = self._began if cycle is None else not cycle.response_started
        if cycle is not None:  # the app waiting for the body sees the client gone
            cycle.disconnected = True
            cycle.message_event.set()
        if answer:
            message = f"request {stage} not received within {seconds:g} s"
            self.transport.write(_timeout_response(message))
        self.transport.close()

    # ---- the connection cap ---------------------------------------------------------------
    async def _admit(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or len(self.connections) <= self.limits.max_connections:
            await self._inner_app(scope, receive, send)
            return
        await drain(receive, REFUSAL_DRAIN_BYTES)
        message = (
            f"this server has {self.limits.max_connections} connections open, its limit: "
            "retry shortly"
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"retry-after", RETRY_AFTER_SECONDS.encode()),
            (b"connection", b"close"),
        ]
        body = _error_body(503, message, "too_many_connections")
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def drain(receive: Any, limit: int) -> None:
    """Read and drop a request's body, up to about `limit` bytes, so that the answer sent before
    it reaches a client still sending (a peer closing on unread data resets the connection)."""
    dropped = 0
    while dropped <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _error_body(status: int, message: str, code: str) -> bytes:
    """OpenAI's error object (as shared/serving/http/errors.py writes it)."""
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    error = {"message": message, "type": kind, "param": None, "code": code}
    return json.dumps({"error": error}).encode()


def _timeout_response(message: str) -> bytes:
    """A whole 408 written straight to the transport (no ASGI cycle may exist for it)."""
    body = _error_body(408, message, "request_timeout")
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body
