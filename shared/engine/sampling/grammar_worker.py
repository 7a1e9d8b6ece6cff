"""Compiling grammars in worker processes that are killed at their request's deadline.

xgrammar's compile cannot be interrupted, and a thread cannot be stopped: a schema that compiles
for minutes would keep a core and its memory after its request got its 400. So compiles run in
a few worker processes, forked from a process that imported xgrammar once (grammar_zygote.py;
a fresh interpreter spends seconds importing torch and transformers for xgrammar). A worker
runs at the lowest priority (nice 19), below the node's engine and event loop, keeps each
tokenizer's vocabulary once, compiles one grammar at a time, and is killed when that grammar's
deadline passes or its memory grows past its limit; whatever it allocated returns with it. A
worker whose heap grew past RECYCLE_BYTES over its start exits after its answer (freed memory
stays with a process); the pool starts another when one is needed.

A small grammar comes back serialized (xgrammar's `CompiledGrammar.serialize_json`). A large one
does not: its JSON is about its size (55 MB for a 65 MB grammar) and takes longer to write and
read than to compile again (11 s + 3 s against 4 s), so the worker reports only its size and the
node compiles it again on a low-priority thread. That compile is bounded: the same input already
finished, in time, in the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from shared.engine.sampling.grammar_kinds import (
    GrammarBusy,
    GrammarError,
    compile_spec,
    field_of,
    xgrammar,
)
from shared.engine.sampling.grammar_zygote import Zygote
from shared.engine.sampling.structured_output import StructuredOutput

SHIP_BYTES = 8 * 1024 * 1024  # larger compiled grammars are compiled again by the node
RECYCLE_BYTES = 64 * 1024 * 1024  # a worker whose heap grew more exits after its answer
WORKER_NICE = 19  # the lowest priority: the engine's steps come first
ZYGOTE = Zygote(f"{__name__}:worker_main")  # one per node: every pool forks from it
log = logging.getLogger(__name__)
T = TypeVar("T")
POLL_S = 0.02  # how often the node looks at a running compile (its result, deadline, memory)


@dataclass(frozen=True)
class ChildResult:
    nbytes: int  # the compiled grammar's size, as xgrammar reports it
    payload: str | None  # serialize_json's text, when nbytes <= SHIP_BYTES
    seconds: float  # the compile's own time, in the worker


def anon_bytes(pid: int) -> int:
    """A process's resident anonymous memory (its heap; 0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def worker_main(conn: Connection) -> None:
    """A worker's loop: ("vocab", key, json) keeps a tokenizer's info; ("compile", key, spec)
    answers ("ok", ChildResult, retire) or ("invalid", message, retire)."""
    os.nice(WORKER_NICE)
    xgr = xgrammar()
    compilers: dict[str, Any] = {}
    base = anon_bytes(os.getpid())
    conn.send(("ready", base))
    with contextlib.suppress(EOFError, KeyboardInterrupt):
        while True:
            msg = conn.recv()
            if msg[0] == "vocab":
                info = xgr.TokenizerInfo.deserialize_json(msg[2])
                compilers[msg[1]] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                continue
            answer = _compile(compilers[msg[1]], msg[2])
            conn.send((*answer, anon_bytes(os.getpid()) - base > RECYCLE_BYTES))


def _compile(compiler: Any, spec: StructuredOutput) -> tuple[str, object]:
    start = time.perf_counter()
    try:
        compiled = compile_spec(compiler, spec)
    except GrammarError as e:
        return "invalid", str(e)
    except MemoryError:
        return "invalid", "out of memory"
    seconds = time.perf_counter() - start
    nbytes = int(compiled.memory_size_bytes)
    payload = compiled.serialize_json() if nbytes <= SHIP_BYTES else None
    return "ok", ChildResult(nbytes, payload, seconds)


@dataclass(eq=False)
class _Worker:
    pid: int
    conn: Connection
    base: int  # its heap once ready: what a compile's growth is measured from
    vocabs: set[str] = field(default_factory=set)

    def kill(self) -> None:
        """Kill it (mid-compile: its memory returns now); the zygote reaps it."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def stop(self) -> None:
        self.kill()
        self.conn.close()


def _start_worker(zygote: Zygote, timeout: float | None = None) -> _Worker:
    """A new worker, once it said it is ready (within `timeout`: else it is killed)."""
    pid, conn = zygote.fork()
    worker = _Worker(pid, conn, 0)
    if timeout is not None and not conn.poll(max(timeout, 0.0)):
        worker.stop()
        raise TimeoutError("a grammar compile worker did not start in time")
    status, worker.base = conn.recv()  # ("ready", its heap): xgrammar imported before the fork
    assert status == "ready", status
    return worker


class CompilePool:
    """At most `size` compiles at once, each in a worker of its own; a compile that finds every
    worker busy waits for one until its deadline (then GrammarBusy: 429 / RESOURCE_EXHAUSTED)."""

    def __init__(self, size: int, limit_bytes: int, ahead: int = 2):
        self.size = size
        self.ahead = ahead  # idle workers kept forked ahead, once the node has compiled once
        self.limit_bytes = limit_bytes  # a compile's heap growth past this kills it: a 400
        self._idle: list[_Worker] = []
        self._live = 0  # workers busy, idle or starting
        self._lock = threading.Lock()
        self._closed = False
        self._vocab: tuple[str, str] | None = None  # (key, JSON) a new worker is given first

    @property
    def workers(self) -> int:
        return self._live

    def pids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._idle]

    async def compile(
        self,
        key: str,
        vocab: str,
        spec: StructuredOutput,
        timeout: float,
        deadline: float | None = None,
    ) -> ChildResult:
        """`spec` compiled for tokenizer `key` (`vocab`: its TokenizerInfo JSON) within
        `timeout` seconds of its arrival (waiting for a free worker included; the node's compile
        workers starting up, once, not) and before `deadline` (monotonic seconds, the
        request's). GrammarError when it is invalid, too large or too slow; GrammarBusy when no
        worker is free in that time."""
        end = math.inf if deadline is None else deadline
        worker, clock = await self._acquire(spec, time.monotonic(), timeout, end)
        kill_at = min(clock + timeout, end)
        keep = False
        try:
            # off the event loop and within the time limit: a busy worker at nice 19 may take a
            # while to read 1-2 MB (on the limit it is killed, which ends the send)
            if key not in worker.vocabs:
                await self._send(worker, ("vocab", key, vocab), spec, kill_at, kill_at - clock)
                worker.vocabs.add(key)
            await self._send(worker, ("compile", key, spec), spec, kill_at, kill_at - clock)
            status, value, retire = await self._answer(worker, spec, kill_at, kill_at - clock)
            keep = not retire
        finally:
            self._give_back(worker, keep)
        if status == "invalid":
            raise GrammarError(field_of(spec), str(value))
        assert isinstance(value, ChildResult)
        return value

    async def _acquire(
        self, spec: StructuredOutput, clock: float, timeout: float, end: float
    ) -> tuple[_Worker, float]:
        """A worker, waiting for one until `clock + timeout` (or `end`), and the compile's clock:
        its arrival, or when the zygote came up if the compile waited for that."""
        first = True
        while True:
            now = time.monotonic()
            if not ZYGOTE.up:
                clock = now
            if not first and now >= min(clock + timeout, end):
                raise GrammarBusy(
                    f"all {self.size} grammar compile workers stayed busy past the time this "
                    f"{spec.kind} could wait; retry later"
                )
            with self._lock:
                worker = self._idle.pop() if self._idle else None
                start = worker is None and self._live < self.size
                if start:
                    self._live += 1
            if worker is not None:
                return worker, clock
            if start:
                was_up = ZYGOTE.up
                try:
                    limit = None if not was_up else min(clock + timeout, end) - time.monotonic()
                    worker = await _blocking(_start_worker, ZYGOTE, limit)
                except TimeoutError:
                    with self._lock:
                        self._live -= 1
                    continue  # the loop answers GrammarBusy: its time is up
                except BaseException:
                    with self._lock:
                        self._live -= 1
                    raise
                return worker, clock if was_up else time.monotonic()
            first = False
            await asyncio.sleep(POLL_S)

    def _give_back(self, worker: _Worker, keep: bool) -> None:
        if keep:
            with self._lock:
                self._idle.append(worker)
            return
        worker.stop()
        with self._lock:
            self._live -= 1
        self.refill()

    def refill(self, vocab: tuple[str, str] | None = None) -> None:
        """Start workers in the background until `ahead` are idle (and at most `size` live),
        each given `vocab` (a tokenizer's key and TokenizerInfo JSON; the last one given here)
        before it is idle: a request then finds one ready (forking and reading a vocabulary at
        nice 19 on a busy machine can take seconds)."""
        if vocab is not None:
            self._vocab = vocab
        with self._lock:
            if self._closed or len(self._idle) >= self.ahead or self._live >= self.size:
                return

        def run() -> None:
            while True:
                with self._lock:
                    if self._closed or self._live >= self.size or len(self._idle) >= self.ahead:
                        return
                    self._live += 1
                try:
                    worker = _start_worker(ZYGOTE)
                    if (given := self._vocab) is not None:
                        worker.conn.send(("vocab", *given))
                        worker.vocabs.add(given[0])
                except (OSError, RuntimeError, EOFError) as e:  # the next compile says why
                    with self._lock:
                        self._live -= 1
                    log.warning("grammar compile worker: %s", e)
                    return
                with self._lock:
                    closed = self._closed
                    if not closed:
                        self._idle.append(worker)
                if closed:
                    worker.stop()
                    with self._lock:
                        self._live -= 1

        threading.Thread(target=run, name="grammar-workers", daemon=True).start()

    async def _answer(
        self, worker: _Worker, spec: StructuredOutput, kill_at: float, allowed: float
    ) -> tuple[str, object, bool]:
        while not worker.conn.poll():  # True on an answer, or EOF: the worker died
            if time.monotonic() >= kill_at:
                raise GrammarError(field_of(spec), _too_slow(spec, allowed))
            if anon_bytes(worker.pid) - worker.base > self.limit_bytes:
                raise GrammarError(field_of(spec), _too_large(spec, self.limit_bytes))
            await asyncio.sleep(POLL_S)
        try:
            return await _blocking(worker.conn.recv)
        except EOFError:
            raise GrammarError(field_of(spec), f"the {spec.kind} crashed its compiler") from None

    async def _send(
        self,
        worker: _Worker,
        msg: tuple[object, ...],
        spec: StructuredOutput,
        kill_at: float,
        allowed: float,
    ) -> None:
        # a task, not a coroutine: awaited again below once its shield timed out
        sending = asyncio.ensure_future(_blocking(worker.conn.send, msg))
        try:
            await asyncio.wait_for(asyncio.shield(sending), kill_at - time.monotonic())
        except TimeoutError:
            worker.kill()  # the send fails at once (a broken pipe); then its connection closes
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(sending, 5.0)
            raise GrammarError(field_of(spec), _too_slow(spec, allowed)) from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._live -= len(idle)
        for worker in idle:
            worker.stop()


_IO = ThreadPoolExecutor(32, "grammar-io")  # blocking pipe work, not the loop's default pool


async def _blocking(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` on the pool's own threads: waits on workers that may be slow to run (nice
    19 on a busy machine) must not take the threads the rest of the node uses."""
    return await asyncio.get_running_loop().run_in_executor(_IO, fn, *args)


def _too_slow(spec: StructuredOutput, allowed: float) -> str:
    return f"the {spec.kind} did not compile within {max(allowed, 0):.3g}s; simplify it"


def _too_large(spec: StructuredOutput, limit: int) -> str:
    return (
        f"the {spec.kind} needs more than {limit / 2**20:.0f} MiB to compile; make it smaller "
        "(fewer enum values, properties or alternatives)"
    )
