"""Runs an EngineCore on a thread of its own, driven from an asyncio event loop.

The engine thread owns every piece of engine state (scheduler, seats, blocks, requests). The
event loop never touches it directly: it submits commands (`call`, shared/engine/commands.py),
which the thread runs between steps, and receives token deltas and the role's events (on a
decode node, admission grants) through callbacks scheduled onto the loop. While there is no
work the thread sleeps on a condition variable, so an idle node burns no CPU; deadlines are
enforced by timers on the event loop, never by the engine noticing new work.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from shared.engine.commands import Command, WarmUp
from shared.engine.core import EngineCore
from shared.engine.info import EngineInfo
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import LlmRequestState
from shared.engine.runtime import openmp

log = logging.getLogger(__name__)
T = TypeVar("T")

# A step holds the GIL between its torch ops (each op releases it and at once takes it back), so
# an event loop woken with a command's result or a step's tokens waits for CPython's forced
# switch, 5 ms by default, before it can send them. 0.2 ms bounds that wait. Measured on the P/D
# first-token path (docs/performance.md, "Local prefill"): with this and COMMAND_HANDOFF_S, the
# decode node's "transfer complete -> first token at the client" fell from 4-5 ms to 2.7-3 ms.
GIL_SWITCH_INTERVAL_S = 2e-4
# After running commands, and before its next step, the engine thread sleeps this long: the loop
# (woken by the commands' results) takes the GIL and answers before the step's Python runs.
COMMAND_HANDOFF_S = 5e-5


@dataclass
class EngineSnapshot:
    """Counters published after every step or command, read by /metrics without locking."""

    seq_slots_in_use: int = 0
    seq_slots_total: int = 0
    blocks_in_use: int = 0
    blocks_total: int = 0
    blocks_pinned: int = 0
    blocks_cached: int = 0
    requests_by_state: dict[str, int] = field(default_factory=dict)
    queued: int = 0  # requests holding nothing while they wait for blocks
    preemptions: int = 0  # since start
    waiting: int = 0
    running: int = 0
    steps: int = 0
    # speculative decoding since start: drafts proposed and accepted, verifying steps of a
    # request and the tokens they yielded
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    draft_steps: int = 0
    draft_step_tokens: int = 0


class EngineThread:
    def __init__(
        self,
        core: EngineCore,
        loop: asyncio.AbstractEventLoop,
        on_deltas: Callable[[list[TokenDelta]], None],
        name: str = "engine",
        on_event: Callable[[object], None] | None = None,
        on_crash: Callable[[BaseException], None] | None = None,
    ):
        self.core = core
        self.info: EngineInfo = core.info
        self._loop = loop
        if on_event is not None:
            core.bind_events(lambda event: loop.call_soon_threadsafe(on_event, event))
        self._on_deltas = on_deltas
        self._on_crash = on_crash  # on the loop: the node fails what waits on the engine
        self._commands: deque[tuple[Callable[[EngineCore], object], Future[object]]] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.snapshot = EngineSnapshot()
        self.fatal_error: BaseException | None = None
        self._torch_threads = 0  # set by start: the threads borrowed from the starting thread
        self._publish()

    def start(self) -> None:
        # process-wide, and meant so: this process serves an event loop beside its engine
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._torch_threads = openmp.lend()  # shared/engine/runtime/openmp.py: one OpenMP team only
        self._thread.start()

    async def start_warm(self) -> None:
        """`start`, then run the start-up warm-up (shared/engine/runtime/warmup.py) on the thread,
        so that a node reports ready only once its first request would run at full speed."""
        self.start()
        await self.call(WarmUp())

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        if self._torch_threads:
            self._torch_threads = 0
            openmp.give_back()

    def submit(self, command: Command) -> Future[Any]:
        """Queue a command for the engine thread; its result (or error) on the future."""
        return self._submit(lambda core: core.execute(command))

    async def call(self, command: Command) -> Any:
        """Run `command` on the engine thread between steps and return its result."""
        return await asyncio.wrap_future(self.submit(command))

    async def inspect(self, fn: Callable[[EngineCore], T]) -> T:
        """Run `fn(core)` on the engine thread: for tests and benchmarks that look inside a
        running engine; nodes use commands only."""
        return await asyncio.wrap_future(self.inspect_soon(fn))

    def inspect_soon(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """`inspect` without waiting: the future of `fn(core)`."""
        return self._submit(fn)

    def _submit(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        fut: Future[T] = Future()
        with self._cv:
            if self._stopping:
                fut.set_exception(RuntimeError("engine is shutting down"))
                return fut
            self._commands.append((fn, fut))  # type: ignore[arg-type]
            self._cv.notify()
        return fut

    def _run(self) -> None:
        torch.set_num_threads(self._torch_threads)
        try:
            while True:
                with self._cv:
                    while not self._commands and not self.core.has_work and not self._stopping:
                        self._cv.wait()
                    if self._stopping and not self._commands:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, fut in commands:
                    self._run_command(fn, fut)
                if commands:
                    self.core.admit_queued()  # a command (abort, failure) may free blocks
                    if self.core.has_work:
                        time.sleep(COMMAND_HANDOFF_S)
                if self.core.has_work:
                    deltas = self.core.step()
                    if deltas:
                        self._loop.call_soon_threadsafe(self._on_deltas, deltas)
                self._publish()
        except BaseException as e:  # a crashed engine must not look like an idle one
            log.exception("engine thread crashed")
            self.fatal_error = e
            self._fail_pending(e)
            if self._on_crash is not None:
                self._loop.call_soon_threadsafe(self._on_crash, e)

    def _run_command(self, fn: Callable[[EngineCore], object], fut: Future[object]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(self.core))
        except BaseException as e:
            fut.set_exception(e)
        self._publish()

    def _fail_pending(self, error: BaseException) -> None:
        with self._cv:
            self._stopping = True
            commands = list(self._commands)
            self._commands.clear()
        for _, fut in commands:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(f"engine crashed: {error!r}"))

    def _publish(self) -> None:
        core = self.core
        states: dict[str, int] = {s.name: 0 for s in LlmRequestState}
        for request in core.requests.values():
            states[request.state.name] += 1
        blocks = core.kv_manager.blocks
        self.snapshot = EngineSnapshot(
            seq_slots_in_use=core.seq_slot_manager.num_in_use,
            seq_slots_total=core.max_num_sequences,
            blocks_in_use=blocks.num_used_blocks,
            blocks_total=blocks.num_blocks,
            blocks_pinned=blocks.num_pinned_blocks,
            blocks_cached=blocks.num_cached_blocks,
            requests_by_state=states,
            queued=states[LlmRequestState.QUEUED.name],
            preemptions=core.scheduler.num_preemptions,
            waiting=len(core.scheduler.waiting),
            running=len(core.scheduler.running),
            steps=core.num_steps,
            **_draft_counts(core),
        )


def _draft_counts(core: EngineCore) -> dict[str, int]:
    drafter = core.drafter
    if drafter is None:
        return {}
    return {
        "drafts_proposed": drafter.proposed,
        "drafts_accepted": drafter.accepted,
        "draft_steps": drafter.steps,
        "draft_step_tokens": drafter.tokens,
    }
