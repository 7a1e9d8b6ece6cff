"""The answer to a request the server cuts off when the node shuts down.

On SIGTERM the node stops admitting and gives in-flight requests its drain grace; when the grace
ends uvicorn cancels the requests still running. Left alone, that cancellation reaches uvicorn,
which answers a plain-text `500 Internal Server Error` (or drops a stream without its end). This
ASGI middleware answers instead as the API does everywhere else: `503` with OpenAI's error object
and `Retry-After` (another node can serve it), or, on a stream already begun, an error event and
`[DONE]` so the client sees why it ended. Nothing else cancels a request's task: a client that
goes away is noticed by the app itself (shared/serving/http/app.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from shared.serving.http.errors import ApiError
from shared.serving.http.sse import DONE

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

CUT_OFF = (
    "the node shut down before this request finished (its drain grace ended); retry it on "
    "another node"
)


class ShutdownAnswer:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started: Message | None = None
        ended = False

        async def tracked(message: Message) -> None:
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = message
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if ended or (started is not None and not _is_stream(started)):
                raise  # nothing more to say: the answer was complete, or half a JSON body
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # the cancellation is answered here, not propagated
            await _answer(send, started is not None)


def _is_stream(start: Message) -> bool:
    headers = dict(start.get("headers") or [])
    return headers.get(b"content-type", b"").startswith(b"text/event-stream")


async def _answer(send: Send, streaming: bool) -> None:
    error = ApiError(503, CUT_OFF, code="shutdown")
    if streaming:
        await send({"type": "http.response.body", "body": error.sse_event() + DONE})
        return
    response = error.response()
    await send({"type": "http.response.start", "status": 503, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
