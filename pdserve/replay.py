"""The proxy's view of one call's client stream: read once, replayable to a second backend."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from grpc import aio

# Requests of one call kept for a retry; a longer client stream is not retried.
MAX_REPLAY_MESSAGES = 64


class ReplayableRequests:
    """The client's request stream, read once: each attempt replays what was read so far and
    then follows the live stream. Replay stops being possible once a backend has answered
    (`commit`) or the stream grew past MAX_REPLAY_MESSAGES."""

    def __init__(self, request_iterator: AsyncIterator[bytes]):
        self.history: list[bytes] | None = []
        self.ended = False
        self._queue: asyncio.Queue[bytes | None] | None = None
        # the first message (None: the stream ended without one), for routing on its content
        self._first: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._read(request_iterator))

    @property
    def replayable(self) -> bool:
        return self.history is not None

    def commit(self) -> None:
        self.history = None

    async def _read(self, request_iterator: AsyncIterator[bytes]) -> None:
        try:
            async for msg in request_iterator:
                if not self._first.done():
                    self._first.set_result(msg)
                if self.history is not None:
                    self.history.append(msg)
                    if len(self.history) > MAX_REPLAY_MESSAGES:
                        self.history = None
                if self._queue is not None:
                    self._queue.put_nowait(msg)
        finally:
            self.ended = True
            if not self._first.done():
                self._first.set_result(None)
            if self._queue is not None:
                self._queue.put_nowait(None)

    async def first(self) -> bytes | None:
        """The client's first request message, once it came (None if the stream ended first)."""
        return await asyncio.shield(self._first)

    async def feed(self, call: aio.StreamStreamCall) -> None:
        """Write this call's requests (replay + live), then half-close."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        for msg in self.history or ():
            queue.put_nowait(msg)
        if self.ended:
            queue.put_nowait(None)
        self._queue = queue
        with contextlib.suppress(Exception):  # the call ended (error or cancel): stop writing
            while (msg := await queue.get()) is not None:
                await call.write(msg)
            await call.done_writing()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
