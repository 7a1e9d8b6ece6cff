"""ASGI middleware in front of the API routes: the bearer token, the request-size limit and
Unicode text in every string.

All are checked before the body is parsed: a wrong key is a 401 whatever the body holds, an
oversized body is a 413 without ever being held in memory (it is read and dropped so that the
client, still sending, gets to read the answer instead of a connection reset), and a string that
is not Unicode text (a lone surrogate) is a 400 naming its field (unicode_text.py says why).
"""

from __future__ import annotations

import hmac
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.serving.connection_limits import drain
from shared.serving.http.errors import ApiError
from shared.serving.http.refusals import count_refusal
from shared.serving.http.unicode_text import lone_surrogate

# how much of an oversized body is read and dropped before the connection is just closed
DRAIN_LIMIT_BYTES = 256 * 1024 * 1024
# vLLM's tokenizer routes sit beside /v1/ and take the same guard
GUARDED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
_GONE = object()  # the client disconnected before its body was complete


class ApiGuard:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.key = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path.startswith("/v1/") or path in GUARDED_PATHS):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.key is not None and not hmac.compare_digest(
            headers.get(b"authorization", b""), self.key
        ):
            error = ApiError(401, "missing or invalid API key", code="invalid_api_key")
            await _reply(error, scope, receive, send)
            return
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await drain(receive, DRAIN_LIMIT_BYTES)
            await _reply(self._too_large(), scope, receive, send)
            return
        body = await _read_body(receive, self.max_bytes)
        if body is _GONE:
            return  # nobody to answer: the app never starts on a partial body
        if body is None:
            await drain(receive, DRAIN_LIMIT_BYTES)
            await _reply(self._too_large(), scope, receive, send)
            return
        assert isinstance(body, bytes)
        bad = lone_surrogate(body)
        if bad is not None:
            field, problem = bad
            message = f"'{field}' {problem}" if field else f"the request body {problem}"
            await _reply(ApiError(400, message, param=field or None), scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"request body exceeds the limit of {self.max_bytes} bytes",
            code="request_too_large",
        )


async def _read_body(receive: Receive, limit: int) -> bytes | object | None:
    """The whole body, None as soon as it passes `limit` bytes, or _GONE when the client
    disconnected (or missed its body deadline, connection_limits.py) before its end."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return _GONE
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body once, then the real channel (so a disconnect is still seen)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _reply(error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    count_refusal(scope.get("app"), error.status)
    response: Any = error.response()
    await response(scope, receive, send)
