"""Several async streams read as one, items interleaved as they come: a request's prompts
answered side by side (n prompts, one response)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")

_END = object()


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Interleave a batch's choices as they come; the first error ends them all."""
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for piece in stream:
                    queue.put_nowait(piece)
            queue.put_nowait(_END)
        except Exception as e:
            queue.put_nowait(e)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
