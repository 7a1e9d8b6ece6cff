"""Decode side of the KV push: a UCX listener that lands validated KV payloads in the pool.

Each KV message is a header and a payload (`transfer.protocol`). After every progress round the
receiver probes the worker for any tagged message: a live transfer id is a header (received into a
small host buffer, checked by `protocol.validate_header` and the transfer's `Landing`, then its
(layer, block) pairs are claimed); the MAC of a registered (transfer, seq) is a payload (received
with ONE UCX receive scattered straight over the claimed blocks, from `KvLayout.block_spans`; one
that comes before its header waits for it); anything else is drained with a 1-byte truncating
receive and counted. So nothing is written into the pool before a header carrying the transfer's
token has been validated, and only into the blocks that header claimed. A bad message without the
token is noise (the transfer goes on); one with it fails the transfer at once. A failed transfer
stays fenced while payload writes are posted (`quiesced`, `release`: see `transfer.landing`).

All methods run on the loop the receiver was started on; `on_layer` callbacks run there too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from shared.kv.layout import KvLayout
from transfer import protocol
from transfer.errors import (
    ProtocolError,
    TransferCancelled,
    TransferError,
    TransferReset,
    TransferSenderRestarted,
    TransferTimeout,
    retrieve_exception,
)
from transfer.landing import (
    SEQ_WINDOW,
    Announced,
    Landing,
    LandingState,
    Progress,
    TransferStats,
    check_reservation,
)
from transfer.landings import Landings
from transfer.listener import CLOSE_TIMEOUT_S, KvListener
from transfer.pool_writer import PoolWriter
from transfer.protocol import TransferDestination
from transfer.receiver_counts import ReceiverCounts
from transfer.ucp import Probe
from transfer.worker import UcxWorker

log = logging.getLogger(__name__)


class KvReceiver(ReceiverCounts):
    """Decode-side endpoint of the KV push; lives on the decode node's event loop."""

    def __init__(
        self,
        kv_pool: torch.Tensor,
        layout: KvLayout,
        host: str = "127.0.0.1",
        port: int = 0,
        bind_host: str | None = None,
        instance_id: int = 0,
    ) -> None:
        """`host`: the address peers connect to (advertised in every TransferDestination);
        `bind_host`: the address the UCX listener binds to (default: `host`; "0.0.0.0" or "::"
        for every interface); `instance_id`: this node process's (ModelInfo.instance_id)."""
        self.instance_id = instance_id
        self._writer = PoolWriter(kv_pool, layout)
        self._pool = kv_pool
        self._layout = layout
        self._fingerprint = protocol.fingerprint_bytes(layout.fingerprint())
        self._host = host
        self._bind_host = host if bind_host is None else bind_host
        self._port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._net: KvListener | None = None
        self._landings = Landings()  # late messages are told from noise for 10 minutes
        ReceiverCounts.__init__(self)
        self._sink = np.zeros(1, dtype=np.uint8)  # truncating receives of dropped messages
        self._writing = 0

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Create the UCX worker on the running loop and listen on `bind_host`:`port` (port 0:
        ephemeral). `host` is the address advertised to peers."""
        if self._net is not None:
            raise RuntimeError("KvReceiver already started")
        self._writer.start()
        self._loop = asyncio.get_running_loop()
        self._net = KvListener(self._loop, self._bind_host, self._port, self._reset_live)
        self._net.add_hook(self._drain_unexpected)

    @property
    def _worker(self) -> UcxWorker | None:  # the listener's (a restart replaces it)
        return None if self._net is None else self._net.worker

    @property
    def address(self) -> str:
        if self._net is None:
            raise RuntimeError("KvReceiver not started")
        return protocol.join_address(self._host, self._net.port)

    @property
    def bound(self) -> tuple[str, int]:
        """(ip, port) the listener is bound to."""
        if self._net is None:
            raise RuntimeError("KvReceiver not started")
        return self._net.ip, self._net.port

    async def close(self) -> None:
        """Fail live transfers (TransferCancelled), close peer endpoints (which ends every
        posted receive), then the listener, then the UCX worker."""
        net = self._net
        if net is None:
            return
        for t in list(self._landings.live.values()):
            self._fail(t, TransferCancelled(f"transfer {t.transfer_id:#x}: receiver closed"))
        self._net = None
        await net.close(force=bool(self._landings.fenced))

    # ---- transfers ----------------------------------------------------------------------------
    def expect(
        self,
        request_id: str,
        block_ids: Sequence[int],
        on_layer: Callable[[int], None] | None = None,
        skipped: Sequence[int] = (),
        sender: int = 0,
        lease: float | None = None,
    ) -> TransferDestination:
        """Register a transfer granted to sender instance `sender` (0: none named): every
        layer must deliver every one of `block_ids` exactly once but the first
        `skipped[layer]` (empty: none), which it must not. `on_layer(layer)` is called once per
        layer, in layer order, when all of that layer's blocks have landed. `lease`: seconds
        from now after which the transfer fails (TransferTimeout) whatever its sender does or
        whether anyone waits; else the deadline starts with `wait`."""
        if self._worker is None:
            raise RuntimeError("KvReceiver not started")
        ids = tuple(int(b) for b in block_ids)
        check_reservation(ids, self._pool.shape[2])
        layers, now = self._layout.num_layers, time.monotonic()
        skip = tuple(int(n) for n in skipped)
        t = self._landings.open(request_id, ids, layers, on_layer, self._loop, now, skip, sender)
        if lease is not None:
            t.arm_deadline(self._loop, lease, self._on_deadline)
        fingerprint = self._layout.fingerprint()
        address, tid, token = self.address, t.transfer_id, t.token
        return TransferDestination(
            address, tid, token, ids, fingerprint, skip, sender, self.instance_id
        )

    def sender_restarted(self, instance: int, why: str) -> int:
        """Fail every live transfer granted to sender instance `instance` (its process is gone:
        a new instance answers on its address) with TransferSenderRestarted; returns how many."""
        doomed = self._landings.granted_to(instance) if instance else []
        for t in doomed:
            self._fail(t, TransferSenderRestarted(f"transfer {t.transfer_id:#x}: {why}"))
        self.senders_restarted += len(doomed)
        return len(doomed)

    async def wait(self, transfer_id: int, timeout: float) -> TransferStats:
        """Return when every layer of every block has landed. Raises TransferTimeout when
        `timeout` seconds pass first (whether or not messages arrive), TransferCancelled after
        `cancel`, TransferError when the data is bad or the receive failed; in all these cases
        the transfer is torn down (and fenced while writes are still posted: `quiesced`)."""
        t = self._landings.find(transfer_id)
        if t is None:
            raise TransferError(f"transfer {transfer_id:#x} is unknown or already collected")
        if t.live:
            t.arm_deadline(self._loop, timeout, self._on_deadline)
        try:
            return await asyncio.shield(t.done)
        finally:
            if t.done.done():
                self._landings.collect(transfer_id)

    def cancel(self, transfer_id: int) -> None:
        """Tear the transfer down (waiters get TransferCancelled); idempotent, unknown ids are
        ignored, late messages for it are dropped. Its blocks may still be written until
        `quiesced(transfer_id)` resolves."""
        t = self._landings.live.get(transfer_id)
        if t is not None:
            self._fail(t, TransferCancelled(f"transfer {transfer_id:#x} cancelled"))
        self._landings.collect(transfer_id)

    def quiesced(self, transfer_id: int) -> asyncio.Future[None]:
        """Resolves once nothing can write into the transfer's blocks any more (immediately for
        unknown and already quiet transfers). Only meaningful after it completed or failed."""
        t = self._landings.fenced.get(transfer_id) or self._landings.live.get(transfer_id)
        if t is not None:
            return t.quiesced
        done: asyncio.Future[None] = self._loop.create_future()
        done.set_result(None)
        return done

    async def release(self, transfer_id: int, timeout: float) -> None:
        """Cancel the transfer and return once its blocks may be reused. Waits up to `timeout`
        for posted payload writes to end; then force-closes every accepted endpoint (the only
        way to end a matched receive whose sender stalled), failing other transfers in flight,
        and waits for the writes to be cancelled."""
        self.cancel(transfer_id)
        fence = self.quiesced(transfer_id)
        if fence.done():
            return
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(fence), timeout)
        log.warning(
            "transfer %#x: a payload write still posted %.3gs after it ended (sender stalled "
            "mid-message?): force-closing every KV endpoint, failing the %d transfers in flight",
            transfer_id,
            timeout,
            self.live_transfers,
        )
        self.endpoint_resets += 1
        # the reset may discard messages their senders already count as sent
        self._reset_live(f"KV endpoints reset to end a stalled write of transfer {transfer_id:#x}")
        if self._net is not None:
            await self._net.reset()
        await asyncio.wait_for(asyncio.shield(fence), CLOSE_TIMEOUT_S)

    def _reset_live(self, why: str) -> None:
        """Fail every live transfer with TransferReset (this node's doing: a retry may go to the
        same prefill node); also what the listener calls before it restarts."""
        for t in list(self._landings.live.values()):
            self._fail(t, TransferReset(f"transfer {t.transfer_id:#x}: {why}"))

    # ---- UCX side -----------------------------------------------------------------------------
    def _drain_unexpected(self) -> None:
        worker = self._worker
        while worker is not None and (probe := worker.probe()) is not None:
            self._dispatch(probe)

    def _dispatch(self, probe: Probe) -> None:
        t = self._landings.live.get(probe.tag)
        if t is not None:
            if protocol.FIXED_HEADER_BYTES <= probe.length <= t.max_header:
                self._receive_header(t, probe)
            else:
                self._drop(probe, protocol.REJECT_BAD_LENGTH)
            return
        t = self._landings.payload_owner(probe.tag)
        if t is not None:
            self._on_payload(t, t.tags[probe.tag], probe)
            return
        dead = self._landings.is_dead(probe.tag)
        self._drop(probe, protocol.REJECT_LATE if dead else protocol.REJECT_UNKNOWN_TRANSFER)

    def _drop(self, probe: Probe, reason: str) -> None:
        """Count and drain an unwanted message without reading it (truncating receive)."""
        self._count_reject(reason)
        self._worker.recv_probed(probe, self._sink).add_done_callback(retrieve_exception)

    # ---- headers ------------------------------------------------------------------------------
    def _receive_header(self, t: Landing, probe: Probe) -> None:
        buf = np.empty(probe.length, dtype=np.uint8)
        fut = self._worker.recv_probed(probe, buf)
        if fut.done():  # eager messages complete in place: keep the arrival order
            self._on_header(t, buf, fut)
        else:
            fut.add_done_callback(lambda f: self._on_header(t, buf, f))

    def _on_header(self, t: Landing, buf: np.ndarray, fut: asyncio.Future) -> None:
        error = None if fut.cancelled() else fut.exception()
        if not t.live:
            self._count_reject(protocol.REJECT_LATE)
            return
        if error is not None or fut.cancelled():
            self._fail_recv(t, error)
            return
        try:
            prefix, ids = protocol.validate_header(
                buf.tobytes(),
                transfer_id=t.transfer_id,
                token=t.token,
                layout=self._layout,
                fingerprint=self._fingerprint,
                max_blocks=len(t.block_ids),
                instance_id=t.instance,
            )
            announced = t.check_claims(prefix, ids)
            t.check_delta(prefix.seq, protocol.decode_mrope_delta(buf, prefix))
        except ProtocolError as e:
            self._count_reject(e.reason)
            if e.reason not in protocol.NOISE_REASONS:  # from this transfer's own sender
                self._fail_bad(t, str(e))
            return
        t.claim(prefix.seq, announced)
        self._landings.open_window(t, prefix.seq + 1 + SEQ_WINDOW)
        early = t.early.pop(prefix.seq, None)
        if early is not None:
            self._on_payload(t, prefix.seq, early)

    # ---- payloads -----------------------------------------------------------------------------
    def _on_payload(self, t: Landing, seq: int, probe: Probe) -> None:
        announced = t.take_announced(seq)
        if announced is None:
            if t.is_repeat(seq):
                self._drop(probe, protocol.REJECT_DUPLICATE)
                self._fail_bad(t, f"{protocol.REJECT_DUPLICATE}: payload {seq} twice")
            else:
                t.early[seq] = probe  # its header has not been validated yet
            return
        self._landings.forget_tag(t, probe.tag, time.monotonic())
        if probe.length != announced.nbytes:
            self._drop(probe, protocol.REJECT_BAD_LENGTH)
            self._fail_bad(
                t,
                f"{protocol.REJECT_BAD_LENGTH}: payload {seq} is {probe.length} B, its header "
                f"announced {announced.nbytes} B",
            )
            return
        t.writing += 1
        self._writing += 1
        fut, staging = self._writer.post(self._worker, probe, announced)
        fut.add_done_callback(lambda f: self._on_written(t, announced, staging, f))

    def _on_written(
        self,
        t: Landing,
        a: Announced,
        staging: torch.Tensor | None,
        fut: asyncio.Future,
    ) -> None:
        t.writing -= 1
        self._writing -= 1
        error = None if fut.cancelled() else fut.exception()
        if t.live:
            if error is not None or fut.cancelled():
                self._fail_recv(t, error)
            else:
                self._writer.land(a, staging)
                self._landed(t, a)
        if not t.live and t.writing == 0:
            self._landings.unfence(t)

    def _landed(self, t: Landing, a: Announced) -> None:
        self.bytes_received_total += a.nbytes
        progress = t.account(a, time.monotonic())
        if progress is Progress.COMPLETE:
            self._complete(t)
        elif progress is Progress.SHORT:
            self._fail(t, TransferError(t.short_message()))
            return
        # Last, so that a callback that cancels its own transfer finds consistent state.
        t.fire_layer_callbacks()

    # ---- teardown -----------------------------------------------------------------------------
    def _complete(self, t: Landing) -> None:
        t.finish(LandingState.COMPLETE)
        t.stats.completed_at = time.monotonic()
        self.completed_total += 1
        self._landings.retire(t, time.monotonic())
        t.done.set_result(t.stats)

    def _fail_recv(self, t: Landing, error: BaseException | None) -> None:
        self._count_reject(protocol.REJECT_RECV_ERROR)
        self._fail(t, TransferError(f"transfer {t.transfer_id:#x}: receive failed: {error}"))

    def _fail_bad(self, t: Landing, what: str) -> None:
        self._fail(t, TransferError(f"transfer {t.transfer_id:#x}: bad KV message: {what}"))

    def _fail(self, t: Landing, error: TransferError) -> None:
        if not t.live:
            return
        self.failed_total += 1
        for probe in t.finish(LandingState.FAILED).values():
            self._drop(probe, protocol.REJECT_LATE)
        self._landings.retire(t, time.monotonic())
        t.done.set_exception(error)
        t.done.exception()  # marks it retrieved: nobody may be waiting

    def _on_deadline(self, t: Landing, timeout: float) -> None:
        self._fail(t, TransferTimeout(t.timeout_message(timeout)))
