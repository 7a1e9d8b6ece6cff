"""One UCX context + worker, progressed by the owner's asyncio loop (no progress thread).

Why not ucxx's async API: its requests spin the loop while they wait and its receives are posted
before the message comes; this worker sleeps on UCX's epoll fd when idle, polls on every loop
iteration while a transfer moves, and receives only probed messages (measurements and the full
rationale: docs/performance.md, "Transfer plane: progress engine").

Everything here runs on the loop thread, UCX callbacks included; nothing is thread safe. A
request keeps its buffers (`keep`) alive until UCX completes it: freeing one UCX still writes
into corrupts memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from transfer.env import configure_ucx_env, context_created

configure_ucx_env()  # before ucxx is imported: UCX reads part of its environment on load

import ucxx._lib.libucxx as ucx_api  # noqa: E402

from transfer import ucp  # noqa: E402  (loads libucp: after the environment is set)
from transfer.ucp_listener import BoundListener, ServerEndpoint  # noqa: E402

log = logging.getLogger(__name__)

UCXError = ucx_api.UCXError
UCXMessageTruncatedError = ucx_api.UCXMessageTruncatedError


def buffer_address(t: torch.Tensor | np.ndarray) -> tuple[int, int]:
    """(address, bytes) of a contiguous tensor/array (device memory stays device memory: UCX
    detects the memory type of the address)."""
    if isinstance(t, np.ndarray):
        if not t.flags.c_contiguous:
            raise ValueError("UCX buffers must be contiguous")
        return t.ctypes.data, t.nbytes
    if not t.is_contiguous():
        raise ValueError("UCX buffers must be contiguous")
    return t.data_ptr(), t.numel() * t.element_size()


@dataclass(slots=True)
class _Op:
    request: object  # ucx_api.UCXRequest
    future: asyncio.Future[None]
    keep: object  # whatever UCX reads from or writes into, alive until completion


# arm() refusals in a row (each after a progress round) before the loop is given back: arm()
# refuses while UCX holds unprocessed events, which the next progress round normally consumes
ARM_ATTEMPTS = 64


class UcxWorker:
    """One UCX worker progressed by one asyncio loop (see the module docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        spin_s: float = 0.0003,
        stalled_tick_s: float = 0.001,
        idle_tick_s: float = 0.5,
        max_progress_rounds: int = 256,
    ) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._spin_s = spin_s
        self._stalled_tick_s = stalled_tick_s
        self._idle_tick_s = idle_tick_s
        self._max_rounds = max_progress_rounds
        self._context = ucx_api.UCXContext(
            feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP)
        )
        context_created()
        self._worker = ucx_api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self._fd = self._worker.epoll_file_descriptor
        self._pending: list[_Op] = []
        self._hooks: list[Callable[[], None]] = []
        self._spin_handle: asyncio.Handle | None = None
        self._tick_handle: asyncio.TimerHandle | None = None
        self._last_progress = time.monotonic()
        self._running = False
        self._closed = False
        # counters, for tests and `measure`
        self.wakeups = 0
        self.spins = 0
        self.arm_refusals = 0  # progress rounds given up to the next tick (see _run_once)
        self._loop.add_reader(self._fd, self._on_event)
        self._run()

    # ---- public -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add_hook(self, hook: Callable[[], None]) -> None:
        """`hook()` runs on the loop after every progress round that made progress (new
        connections, messages, completions); it must not progress the worker itself."""
        self._hooks.append(hook)

    def remove_hook(self, hook: Callable[[], None]) -> None:
        if hook in self._hooks:
            self._hooks.remove(hook)

    def listen(
        self,
        host: str,
        port: int,
        on_endpoint: Callable[[ServerEndpoint], None],
        on_error: Callable[[ServerEndpoint], None],
    ) -> BoundListener:
        """A UCX listener bound to `host`:`port` (port 0: ephemeral; host "0.0.0.0" / "::":
        every interface). `on_endpoint(ep)` is called (inside progress) with each accepted,
        error-handling endpoint, `on_error(ep)` when one fails. Raises UcpError."""
        return BoundListener(self._worker.handle, host, port, on_endpoint, on_error)

    def connect(self, host: str, port: int) -> object:
        """An endpoint to a listener; connection setup completes in the background, sends
        issued before that are queued by UCX, and failures surface as request errors."""
        return ucx_api.UCXEndpoint.create(self._worker, host, port, True)

    def send(self, endpoint: object, buf: torch.Tensor | np.ndarray, tag: int) -> asyncio.Future:
        """Send a contiguous buffer (host or device memory) as one tagged message."""
        address, nbytes = buffer_address(buf)
        return self.submit(ucp.tag_send(endpoint.handle, address, nbytes, tag), buf)

    def send_iov(self, endpoint: object, iov: np.ndarray, keep: object, tag: int) -> asyncio.Future:
        """Send the memory that `iov` (ucp.IOV_DTYPE entries) lists, as one tagged message;
        `keep` (what the entries point into) stays referenced until UCX is done with it."""
        return self.submit(ucp.tag_send_iov(endpoint.handle, iov, tag), (iov, keep))

    def probe(self, tag: int | None = None) -> ucp.Probe | None:
        """Take the oldest unexpected tagged message (with tag `tag`; None: any) off the worker,
        or None. The message stays reserved for one `recv_probed`/`recv_probed_iov`."""
        return ucp.probe(self._worker.handle, tag)

    def recv_probed(self, probe: ucp.Probe, buf: torch.Tensor | np.ndarray) -> asyncio.Future:
        address, nbytes = buffer_address(buf)
        return self.submit(ucp.recv_probed(self._worker.handle, probe, address, nbytes), buf)

    def recv_probed_iov(self, probe: ucp.Probe, iov: np.ndarray, keep: object) -> asyncio.Future:
        """Receive a probed message scattered over `iov`'s entries (in order)."""
        return self.submit(ucp.recv_probed_iov(self._worker.handle, probe, iov), (iov, keep))

    def close_endpoint(self, endpoint: object, force: bool = False) -> asyncio.Future:
        """Close an endpoint (flushing it; `force`: failing what is outstanding on it, posted
        receives of its messages included; accepted endpoints only); call at most once per
        endpoint. An endpoint that already failed or closed is released when its last
        reference goes."""
        if isinstance(endpoint, ServerEndpoint):  # accepted by a BoundListener
            if endpoint.closing:
                raise RuntimeError(f"endpoint from {endpoint.peer} already closing")
            return self.submit(endpoint.close(force), endpoint)
        if not endpoint.alive:
            done: asyncio.Future[None] = self._loop.create_future()
            done.set_result(None)
            return done
        # ucxx returns a null request for an endpoint already closing, which crashes when used:
        # hence alive-only and at-most-once.
        return self.submit(endpoint.close(), endpoint)

    def submit(self, request: object, keep: object = None) -> asyncio.Future:
        """Track a UCX request; the future resolves when UCX completes it (with the request's
        error, if any). Cancelling the future does not cancel the request: UCX may still use
        the buffer, which stays referenced until the request completes."""
        future: asyncio.Future[None] = self._loop.create_future()
        op = _Op(request, future, keep)
        if request.completed:
            _resolve(op)
            return future
        if self._closed:
            future.set_exception(UCXError("UCX worker closed"))
            return future
        self._pending.append(op)
        self._last_progress = time.monotonic()  # a new request gets a fresh spin budget
        self._spin_soon()
        return future

    def close(self) -> None:
        """Stop progressing and release the worker. Close endpoints and listeners first."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        for handle in (self._spin_handle, self._tick_handle):
            if handle is not None:
                handle.cancel()
        self._spin_handle = self._tick_handle = None
        self._hooks.clear()
        if self._pending:
            # Lets UCX release its references to our buffers before they go away.
            self._worker.cancel_inflight_requests(period=10**9, max_attempts=1)
            self._complete()
        for op in self._pending:
            if not op.future.done():
                op.future.set_exception(UCXError("UCX worker closed"))
        self._pending.clear()
        self._worker = None
        self._context = None

    # ---- progress policy ----------------------------------------------------------------------
    def _on_event(self) -> None:
        self.wakeups += 1
        self._run()

    def _on_spin(self) -> None:
        self._spin_handle = None
        self.spins += 1
        self._run()

    def _on_tick(self) -> None:
        self._tick_handle = None
        self._run()

    def _spin_soon(self) -> None:
        if self._spin_handle is None and not self._closed:
            self._spin_handle = self._loop.call_soon(self._on_spin)

    def _run(self) -> None:
        if self._closed or self._running:
            return
        self._running = True
        try:
            self._run_once()
        finally:
            self._running = False

    def _run_once(self) -> None:
        for _ in range(ARM_ATTEMPTS):
            if self._closed:
                return
            progressed = self._progress()
            if self._pending and (
                progressed or time.monotonic() - self._last_progress < self._spin_s
            ):
                self._spin_soon()
                return
            if self._worker.arm():
                self._schedule_tick(self._stalled_tick_s if self._pending else self._idle_tick_s)
                return
            # arm() refused: events arrived since the last progress; progress them first.
        # arm() went on refusing while progress found nothing to do (seen once in a CI run,
        # in-process nodes: it held the event loop for good). Never hold the loop: look again
        # on the next tick, as a stalled transfer would.
        self.arm_refusals += 1
        self._schedule_tick(self._stalled_tick_s)

    def _progress(self) -> bool:
        made = False
        for _ in range(self._max_rounds):
            if not self._worker.progress_once():
                break
            made = True
        self._complete()
        if made:
            self._last_progress = time.monotonic()
            for hook in tuple(self._hooks):
                hook()
        return made

    def _complete(self) -> None:
        if not self._pending:
            return
        still: list[_Op] = []
        for op in self._pending:
            if op.request.completed:
                _resolve(op)
            else:
                still.append(op)
        self._pending = still

    def _schedule_tick(self, delay: float) -> None:
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        self._tick_handle = self._loop.call_later(delay, self._on_tick)


def _resolve(op: _Op) -> None:
    if op.future.done():  # the awaiting side gave up (cancelled); nothing to deliver
        return
    try:
        op.request.check_error()
    except Exception as e:  # the request's own error, whatever UCX class it is, goes to its owner
        op.future.set_exception(e)
    else:
        op.future.set_result(None)
