"""One request on the prefill node, from its Prefill RPC to the end of its KV push."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from shared.engine.errors import RequestRejected
from shared.engine.requests.output import TokenDelta
from shared.model.kv_window import skipped_problem
from transfer.protocol import TransferDestination
from transfer.ucx import KvMessage, KvPush

FINAL = None  # queued after the last message of a request


@dataclass(eq=False)
class PrefillJob:
    """One request on the prefill node: created by its RPC handler on the event loop, its push
    planned by the engine thread's layer hook, its messages sent by the handler."""

    request_id: str
    destination: TransferDestination
    first_block_index: int
    layerwise: bool
    loop: asyncio.AbstractEventLoop
    task: asyncio.Task[object] | None = None  # the RPC handler, cancelled by CancelPrefill
    push: KvPush | None = None  # the KV push, once the destination checked out
    # the handler's compute-and-push task; the deadline's timer; the release (job_table.py)
    work: asyncio.Future[Any] | None = None
    expiry: asyncio.TimerHandle | None = None
    release: asyncio.Future[None] | None = None
    time_limit: float = 0.0  # seconds from arrival the push had
    # the first token's delta (with its logprobs and the prompt's, when asked)
    first_token: asyncio.Future[TokenDelta] = field(init=False)
    admitted_at: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue[KvMessage | None] = field(default_factory=asyncio.Queue)
    sent_upto: int = 0  # prompt blocks [0, sent_upto) are queued for every layer
    cancelled: bool = False
    sent: bool = False  # every KV message sent: the deadline no longer applies
    # why the node gave it up before it ended (job_table.py): its deadline passed first
    # (TimeoutError) or its engine stopped (JobFailed); what its RPC then raises
    given_up: Exception | None = None
    completed: bool = False  # every message sent and the first token known
    first_message_at: float | None = None  # wall clock, for the TTFT breakdown

    def __post_init__(self) -> None:
        self.first_token = self.loop.create_future()

    def put(self, item: KvMessage | None) -> None:
        """From the engine thread: queue a message (or FINAL) for the handler."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def put_many(self, items: list[KvMessage]) -> None:
        """From the engine thread: queue messages in one hop, so the handler finds them queued
        together and sends consecutive layers of the same blocks as one message."""
        if items:
            self.loop.call_soon_threadsafe(_put_all, self.queue, items)

    @property
    def min_message_bytes(self) -> int:
        """The smallest payload the sender measured worth a message of its own (0: unknown)."""
        return 0 if self.push is None else self.push.sender.min_message_bytes

    def dest_ids(self, start: int, stop: int) -> list[int]:
        offset = self.first_block_index
        return list(self.destination.block_ids[start - offset : stop - offset])

    def sends_from(self, layer: int) -> int:
        """The first prompt block `layer` sends (window-aware transfer: the earlier ones fell
        out of its window; shared/model/kv_window.py)."""
        skipped = self.destination.skipped
        return self.first_block_index + (skipped[layer] if skipped else 0)

    def check_destination(self, prompt_len: int, block_size: int, num_layers: int) -> None:
        """RequestRejected unless the destination names a block for each prompt block it is
        sent (and, window-aware, a valid skip per layer)."""
        blocks = -(-prompt_len // block_size)
        want = blocks - self.first_block_index
        got = len(self.destination.block_ids)
        if self.first_block_index >= blocks or got != want:
            raise RequestRejected(
                f"destination.block_ids has {got} blocks from first_block_index "
                f"{self.first_block_index}; a {prompt_len}-token prompt needs {want}"
            )
        skip = skipped_problem(self.destination.skipped, num_layers, want)
        if skip is not None:
            raise RequestRejected(f"destination.{skip}")

    @property
    def pushed(self) -> bool:
        """Whether the decode node has the whole context (the blocks may be unpinned as done)."""
        return self.completed and not self.cancelled


def _put_all(queue: asyncio.Queue[KvMessage | None], items: list[KvMessage]) -> None:
    for item in items:
        queue.put_nowait(item)
