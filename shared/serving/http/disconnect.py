"""A client that goes away cancels its work: the request it started is released on every node
exactly as a gRPC cancel releases it. Shared by the chat, completion and Responses routes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so releasing its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()
