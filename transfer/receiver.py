"""Decode side of the KV push: a UCX listener that lands validated KV payloads in the pool.

Each KV message is a header and a payload (see `transfer.protocol`). The engine's progress hook
probes the worker for any tagged message:

* a tag that is a live transfer id is a header: it is received into a small host buffer and
  checked (magic and version, transfer id, token in constant time, layout, layer, block ids
  inside the reservation and not claimed yet for that layer, sizes, an unused `seq`). A header
  that passes claims its (layer, block) pairs and registers the payload it announces;
* a tag that is the MAC of a registered (transfer, seq) is that transfer's payload. It must have
  exactly the announced size, and it is received with ONE UCX receive scattered straight over the
  claimed pool blocks (an iov list; runs of adjacent blocks become one entry). A payload that
  arrives before its header (UCX does not promise order across its lanes) waits for it;
* anything else (no live transfer, a finished one, noise) is drained with a 1-byte truncating
  receive and counted, never written anywhere.

So nothing is written into the pool before a header carrying the transfer's token has been
validated, and only into the blocks that header claimed inside that transfer's reservation.

Who is blamed for a bad message: a header without the transfer's token is noise (forged,
garbage, misrouted): dropped and counted, the transfer goes on. A bad message that carries the
token (or its MAC) comes from the transfer's own sender, which is then broken: dropped, counted,
and the transfer fails at once with TransferError instead of waiting for its deadline.

Fences: once a payload receive into the pool is posted, UCX writes those blocks until the
receive completes, and a matched receive cannot be cancelled (`ucp_request_cancel` ignores it).
A transfer that fails or is cancelled while payloads are being written therefore stays fenced:
`quiesced(id)` resolves when its last write has ended (completed, or failed because the sender
died). `release(id, timeout)` cancels and waits for the fence; a sender that stalls mid-payload
(SIGSTOP, a hung host) would hold it forever, so after `timeout` the receiver force-closes every
accepted endpoint, which makes UCX fail the posted receives (other transfers in flight fail
too and are retried by their owners). Only after the fence may the blocks be given to anyone
else. CUDA pools receive each payload into a device staging buffer and scatter it (index_copy_
on a side stream) once it has landed; the fence covers those buffers the same way.

All methods run on the loop the receiver was started on; `on_layer` callbacks run there too.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.engine.kv_cache import KvLayout
from transfer import protocol as proto
from transfer import ucp
from transfer.errors import (
    ProtocolError,
    TransferCancelled,
    TransferError,
    TransferTimeout,
    retrieve_exception,
)
from transfer.protocol import TransferDestination
from transfer.ucp import BoundListener, Probe, ServerEndpoint, UcpError
from transfer.worker import UcxWorker

log = logging.getLogger(__name__)

_TOMBSTONE_TTL_S = 600.0  # late messages for a finished transfer are reported as "late" this long
_TOMBSTONE_MAX = 100_000
_CLOSE_TIMEOUT_S = 2.0
SEQ_WINDOW = 64  # payload tags registered ahead of the highest header seq seen: senders keep
# fewer messages than this in flight per transfer


@dataclass
class TransferStats:
    """What landed for one transfer; times are time.monotonic()."""

    transfer_id: int
    request_id: str
    num_blocks: int
    num_layers: int
    expected_at: float
    bytes: int = 0  # payload bytes written into the pool
    messages: int = 0  # accepted messages (header + payload)
    first_message_at: float | None = None
    last_message_at: float | None = None
    layer_completed_at: list[float | None] = field(default_factory=list)
    completed_at: float | None = None


class _State(enum.Enum):
    LIVE = "live"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(eq=False, slots=True)
class _Announced:
    """A validated header: what its payload must be and where it lands."""

    layer: int
    n_layers: int
    ids: tuple[int, ...]
    nbytes: int
    last: bool


@dataclass(eq=False)
class _Transfer:
    transfer_id: int
    request_id: str
    token: bytes
    block_ids: tuple[int, ...]
    position: dict[int, int]  # block id -> index in block_ids
    claimed: list[bytearray]  # per layer, 1 where a validated header claimed that block
    layer_missing: list[int]
    missing: int
    max_header: int
    on_layer: Callable[[int], None] | None
    done: asyncio.Future[TransferStats]
    quiesced: asyncio.Future[None]  # no write into the pool (or staging) is posted any more
    stats: TransferStats
    state: _State = _State.LIVE
    tags: dict[int, int] = field(default_factory=dict)  # registered payload tag -> seq
    window_end: int = 0  # payload tags are registered for seq < window_end
    seen: set[int] = field(default_factory=set)  # seqs of validated headers
    announced: dict[int, _Announced] = field(default_factory=dict)  # seq -> header
    early: dict[int, Probe] = field(default_factory=dict)  # seq -> payload before its header
    writing: int = 0  # payload receives posted and not completed
    deadline: asyncio.TimerHandle | None = None
    next_layer_callback: int = 0


class KvReceiver:
    """Decode-side endpoint of the KV push; lives on the decode node's event loop."""

    def __init__(
        self,
        kv_pool: torch.Tensor,
        layout: KvLayout,
        host: str = "127.0.0.1",
        port: int = 0,
        bind_host: str | None = None,
    ) -> None:
        """`host`: the address peers connect to (advertised in every TransferDestination);
        `bind_host`: the address the UCX listener binds to (default: `host`; "0.0.0.0" or "::"
        for every interface)."""
        _check_pool(kv_pool, layout)
        self._pool = kv_pool
        self._layout = layout
        self._fingerprint = proto.fingerprint_bytes(layout.fingerprint())
        self._block_bytes = layout.block_bytes_per_layer
        self._host = host
        self._bind_host = host if bind_host is None else bind_host
        self._port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: UcxWorker | None = None
        self._listener: BoundListener | None = None
        self._live: dict[int, _Transfer] = {}
        self._payload_tags: dict[int, _Transfer] = {}  # registered payload tag -> its transfer
        self._fenced: dict[int, _Transfer] = {}  # failed transfers with writes still posted
        self._finished: dict[int, _Transfer] = {}  # done, result not collected by wait() yet
        self._dead: OrderedDict[int, float] = OrderedDict()  # ids and payload tags -> expiry
        self._sink = np.zeros(1, dtype=np.uint8)  # truncating receives of dropped messages
        self._scatter_stream: object | None = None  # torch.cuda.Stream for CUDA pools
        self.rejected_total = 0
        self.bytes_received_total = 0
        self.rejected_by_reason: dict[str, int] = {}
        self.completed_total = 0
        self.failed_total = 0
        self.endpoint_resets = 0  # fences broken by force-closing endpoints
        self._writing = 0

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Create the UCX worker on the running loop and listen on `bind_host`:`port` (port 0:
        ephemeral). `host` is the address advertised to peers."""
        if self._engine is not None:
            raise RuntimeError("KvReceiver already started")
        if self._pool.is_cuda:
            torch.cuda.set_device(self._pool.device)  # UCX needs the context current here
            self._scatter_stream = torch.cuda.Stream(self._pool.device)
        self._loop = asyncio.get_running_loop()
        engine = UcxWorker(self._loop)
        try:
            self._listener = engine.listen(
                self._bind_host, self._port, self._on_endpoint, self._on_endpoint_error
            )
        except (UcpError, ValueError) as e:
            engine.close()
            raise TransferError(
                f"cannot listen for KV on {self._bind_host}:{self._port}: {e}"
            ) from e
        self._engine = engine
        engine.add_hook(self._drain_unexpected)

    @property
    def address(self) -> str:
        if self._listener is None:
            raise RuntimeError("KvReceiver not started")
        return f"{_bracket(self._host)}:{self._listener.port}"

    @property
    def bound(self) -> tuple[str, int]:
        """(ip, port) the listener is bound to."""
        if self._listener is None:
            raise RuntimeError("KvReceiver not started")
        return self._listener.ip, self._listener.port

    async def close(self) -> None:
        """Fail live transfers (TransferCancelled), close peer endpoints (which ends every
        posted receive), then the listener, then the UCX worker."""
        engine = self._engine
        listener = self._listener
        if engine is None or listener is None:
            return
        for t in list(self._live.values()):
            self._fail(t, TransferCancelled(f"transfer {t.transfer_id:#x}: receiver closed"))
        listener.destroy()  # no new connections while the old ones close
        force = bool(self._fenced)
        closing = [self._close_endpoint(ep, force) for ep in listener.endpoints if not ep.closing]
        if closing:
            await asyncio.wait(closing, timeout=_CLOSE_TIMEOUT_S)
        self._listener = None
        self._engine = None
        engine.close()  # cancels whatever is still posted before the worker goes

    # ---- transfers ----------------------------------------------------------------------------
    def expect(
        self,
        request_id: str,
        block_ids: Sequence[int],
        on_layer: Callable[[int], None] | None = None,
    ) -> TransferDestination:
        """Register a transfer: every layer must deliver every one of `block_ids` exactly once.
        `on_layer(layer)` is called once per layer, in layer order, when all of that layer's
        blocks have landed. The deadline starts with `wait`."""
        if self._engine is None:
            raise RuntimeError("KvReceiver not started")
        ids = tuple(int(b) for b in block_ids)
        self._check_block_ids(ids)
        self._expire_tombstones()
        transfer_id = self._new_transfer_id()
        token = secrets.token_bytes(proto.TOKEN_BYTES)
        layers = self._layout.num_layers
        now = time.monotonic()
        t = _Transfer(
            transfer_id=transfer_id,
            request_id=request_id,
            token=token,
            block_ids=ids,
            position={b: i for i, b in enumerate(ids)},
            claimed=[bytearray(len(ids)) for _ in range(layers)],
            layer_missing=[len(ids)] * layers,
            missing=len(ids) * layers,
            max_header=proto.header_size(len(ids)),
            on_layer=on_layer,
            done=self._loop.create_future(),
            quiesced=self._loop.create_future(),
            stats=TransferStats(
                transfer_id=transfer_id,
                request_id=request_id,
                num_blocks=len(ids),
                num_layers=layers,
                expected_at=now,
                layer_completed_at=[None] * layers,
            ),
        )
        self._live[transfer_id] = t
        self._extend_window(t, SEQ_WINDOW)
        return proto.TransferDestination(
            address=self.address,
            transfer_id=transfer_id,
            token=token,
            block_ids=ids,
            layout_fingerprint=self._layout.fingerprint(),
        )

    async def wait(self, transfer_id: int, timeout: float) -> TransferStats:
        """Return when every layer of every block has landed. Raises TransferTimeout when
        `timeout` seconds pass first (whether or not messages arrive), TransferCancelled after
        `cancel`, TransferError when the data is bad or the receive failed; in all these cases
        the transfer is torn down (and fenced while writes are still posted: `quiesced`)."""
        t = self._live.get(transfer_id) or self._finished.get(transfer_id)
        if t is None:
            raise TransferError(f"transfer {transfer_id:#x} is unknown or already collected")
        if t.state is _State.LIVE:
            self._set_deadline(t, timeout)
        try:
            return await asyncio.shield(t.done)
        finally:
            if t.done.done():
                self._finished.pop(transfer_id, None)

    def cancel(self, transfer_id: int) -> None:
        """Tear the transfer down (waiters get TransferCancelled); idempotent, unknown ids are
        ignored, late messages for it are dropped. Its blocks may still be written until
        `quiesced(transfer_id)` resolves."""
        t = self._live.get(transfer_id)
        if t is not None:
            self._fail(t, TransferCancelled(f"transfer {transfer_id:#x} cancelled"))
        self._finished.pop(transfer_id, None)

    def quiesced(self, transfer_id: int) -> asyncio.Future[None]:
        """Resolves once nothing can write into the transfer's blocks any more (immediately for
        unknown and already quiet transfers). Only meaningful after it completed or failed."""
        t = self._fenced.get(transfer_id) or self._live.get(transfer_id)
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
        try:
            await asyncio.wait_for(asyncio.shield(fence), timeout)
            return
        except TimeoutError:
            pass
        log.warning(
            "transfer %#x: a payload write is still posted %.3gs after the transfer ended "
            "(sender stalled mid-message?); force-closing every KV endpoint to end it",
            transfer_id,
            timeout,
        )
        self.endpoint_resets += 1
        await self._reset_endpoints()
        await asyncio.wait_for(asyncio.shield(fence), _CLOSE_TIMEOUT_S)

    @property
    def live_transfers(self) -> int:
        return len(self._live)

    @property
    def fenced_transfers(self) -> int:
        """Failed transfers whose blocks a posted payload receive may still write."""
        return len(self._fenced)

    @property
    def writes_in_flight(self) -> int:
        """Payload receives posted into the pool (or staging) and not completed."""
        return self._writing

    # ---- UCX side -----------------------------------------------------------------------------
    def _on_endpoint(self, endpoint: ServerEndpoint) -> None:
        # Inside UCX progress: bookkeeping only (the listener keeps the endpoint).
        log.debug("KV sender connected from %s", endpoint.peer)

    def _on_endpoint_error(self, endpoint: ServerEndpoint) -> None:
        # Inside UCX progress too: closing an endpoint must wait for the loop.
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon(self._close_failed, endpoint)

    def _close_failed(self, endpoint: ServerEndpoint) -> None:
        if self._engine is not None and not endpoint.closing:
            self._close_endpoint(endpoint, force=True)

    def _close_endpoint(self, endpoint: ServerEndpoint, force: bool = False) -> asyncio.Future:
        fut = self._engine.close_endpoint(endpoint, force=force)
        listener = self._listener
        fut.add_done_callback(retrieve_exception)
        if listener is not None:
            fut.add_done_callback(lambda _: listener.forget(endpoint))
        return fut

    async def _reset_endpoints(self) -> None:
        listener = self._listener
        if listener is None:
            return
        closing = [self._close_endpoint(ep, True) for ep in listener.endpoints if not ep.closing]
        if closing:
            await asyncio.wait(closing, timeout=_CLOSE_TIMEOUT_S)

    def _drain_unexpected(self) -> None:
        engine = self._engine
        while engine is not None and (probe := engine.probe()) is not None:
            self._dispatch(probe)

    def _dispatch(self, probe: Probe) -> None:
        t = self._live.get(probe.tag)
        if t is not None:
            if proto.FIXED_HEADER_BYTES <= probe.length <= t.max_header:
                self._receive_header(t, probe)
            else:
                self._drop(probe, proto.REJECT_BAD_LENGTH)
            return
        t = self._payload_tags.get(probe.tag)
        if t is not None:
            self._on_payload(t, t.tags[probe.tag], probe)
            return
        dead = probe.tag in self._dead
        self._drop(probe, proto.REJECT_LATE if dead else proto.REJECT_UNKNOWN_TRANSFER)

    def _drop(self, probe: Probe, reason: str) -> None:
        """Count and drain an unwanted message without reading it (truncating receive)."""
        self._count_reject(reason)
        self._engine.recv_probed(probe, self._sink).add_done_callback(retrieve_exception)

    # ---- headers ------------------------------------------------------------------------------
    def _receive_header(self, t: _Transfer, probe: Probe) -> None:
        buf = np.empty(probe.length, dtype=np.uint8)
        fut = self._engine.recv_probed(probe, buf)
        if fut.done():  # eager messages complete in place: keep the arrival order
            self._on_header(t, buf, fut)
        else:
            fut.add_done_callback(lambda f: self._on_header(t, buf, f))

    def _on_header(self, t: _Transfer, buf: np.ndarray, fut: asyncio.Future) -> None:
        error = None if fut.cancelled() else fut.exception()
        if t.state is not _State.LIVE:
            self._count_reject(proto.REJECT_LATE)
            return
        if error is not None or fut.cancelled():
            self._count_reject(proto.REJECT_RECV_ERROR)
            self._fail(t, TransferError(f"transfer {t.transfer_id:#x}: receive failed: {error}"))
            return
        head = buf.tobytes()
        try:
            prefix = proto.decode_prefix(head)
            if prefix.transfer_id != t.transfer_id:
                raise ProtocolError(proto.REJECT_UNKNOWN_TRANSFER, "header/tag mismatch")
            if not hmac.compare_digest(prefix.token, t.token):
                raise ProtocolError(proto.REJECT_BAD_TOKEN)
        except ProtocolError as e:
            self._count_reject(e.reason)  # not from this transfer's sender: drop, carry on
            return
        try:
            announced = self._check_header(t, prefix, head)
        except ProtocolError as e:
            self._count_reject(e.reason)
            self._fail(t, TransferError(f"transfer {t.transfer_id:#x}: bad KV message: {e}"))
            return
        for layer in range(announced.layer, announced.layer + announced.n_layers):
            claimed = t.claimed[layer]
            for b in announced.ids:
                claimed[t.position[b]] = 1
        t.seen.add(prefix.seq)
        t.announced[prefix.seq] = announced
        self._extend_window(t, prefix.seq + 1 + SEQ_WINDOW)
        early = t.early.pop(prefix.seq, None)
        if early is not None:
            self._on_payload(t, prefix.seq, early)

    def _check_header(self, t: _Transfer, prefix: proto.HeaderPrefix, head: bytes) -> _Announced:
        if prefix.layout_fingerprint != self._fingerprint:
            raise ProtocolError(proto.REJECT_LAYOUT)
        if not (prefix.n_layers >= 1 and prefix.layer + prefix.n_layers <= self._layout.num_layers):
            raise ProtocolError(
                proto.REJECT_BAD_LAYER, f"layers {prefix.layer}..+{prefix.n_layers}"
            )
        if not 0 < prefix.n_blocks <= len(t.block_ids):
            raise ProtocolError(proto.REJECT_BAD_BLOCK, f"{prefix.n_blocks} blocks")
        if len(head) != prefix.header_len:
            raise ProtocolError(
                proto.REJECT_BAD_LENGTH,
                f"header message {len(head)} B, header_len says {prefix.header_len} B",
            )
        expected = prefix.n_layers * prefix.n_blocks * self._block_bytes
        if prefix.payload_bytes != expected:
            raise ProtocolError(
                proto.REJECT_BAD_LENGTH,
                f"header says {prefix.payload_bytes} B payload, {prefix.n_layers} layers of "
                f"{prefix.n_blocks} blocks need {expected} B",
            )
        if prefix.seq in t.seen or prefix.seq >= t.window_end:
            raise ProtocolError(
                proto.REJECT_BAD_SEQ, f"seq {prefix.seq} (window ends at {t.window_end})"
            )
        ids = proto.decode_block_ids(head, prefix)
        layers = range(prefix.layer, prefix.layer + prefix.n_layers)
        seen: set[int] = set()
        for b in ids:
            pos = t.position.get(b)
            if pos is None:
                raise ProtocolError(proto.REJECT_BAD_BLOCK, f"block {b} is not reserved")
            if b in seen:
                raise ProtocolError(proto.REJECT_DUPLICATE, f"block {b} listed twice")
            seen.add(b)
            for layer in layers:
                if t.claimed[layer][pos]:
                    raise ProtocolError(proto.REJECT_DUPLICATE, f"layer {layer} block {b}")
        return _Announced(prefix.layer, prefix.n_layers, ids, expected, prefix.last)

    def _extend_window(self, t: _Transfer, end: int) -> None:
        end = min(end, proto.MAX_SEQ + 1)
        for seq in range(t.window_end, end):
            tag = proto.payload_tag(t.token, t.transfer_id, seq)
            t.tags[tag] = seq
            self._payload_tags[tag] = t
        t.window_end = max(t.window_end, end)

    # ---- payloads -----------------------------------------------------------------------------
    def _on_payload(self, t: _Transfer, seq: int, probe: Probe) -> None:
        announced = t.announced.pop(seq, None)
        if announced is None:
            if seq in t.seen or seq in t.early:
                self._drop(probe, proto.REJECT_DUPLICATE)
                self._fail(
                    t,
                    TransferError(
                        f"transfer {t.transfer_id:#x}: bad KV message: "
                        f"{proto.REJECT_DUPLICATE}: payload {seq} twice"
                    ),
                )
            else:
                t.early[seq] = probe  # its header has not been validated yet
            return
        self._forget_tag(t, probe.tag)
        if probe.length != announced.nbytes:
            self._drop(probe, proto.REJECT_BAD_LENGTH)
            self._fail(
                t,
                TransferError(
                    f"transfer {t.transfer_id:#x}: bad KV message: {proto.REJECT_BAD_LENGTH}: "
                    f"payload {seq} is {probe.length} B, its header announced {announced.nbytes} B"
                ),
            )
            return
        t.writing += 1
        self._writing += 1
        if self._pool.is_cuda:
            staging = torch.empty(announced.nbytes, dtype=torch.uint8, device=self._pool.device)
            fut = self._engine.recv_probed(probe, staging)
        else:
            staging = None
            iov = ucp.pool_iov(self._pool, announced.layer, announced.ids, announced.n_layers)
            fut = self._engine.recv_probed_iov(probe, iov, self._pool)
        fut.add_done_callback(lambda f: self._on_written(t, announced, staging, f))

    def _on_written(
        self,
        t: _Transfer,
        a: _Announced,
        staging: torch.Tensor | None,
        fut: asyncio.Future,
    ) -> None:
        t.writing -= 1
        self._writing -= 1
        error = None if fut.cancelled() else fut.exception()
        if t.state is _State.LIVE:
            if error is not None or fut.cancelled():
                self._count_reject(proto.REJECT_RECV_ERROR)
                self._fail(
                    t, TransferError(f"transfer {t.transfer_id:#x}: receive failed: {error}")
                )
            else:
                if staging is not None:
                    self._scatter(a, staging)
                self._account(t, a)
        if t.state is not _State.LIVE and t.writing == 0:
            self._unfence(t)

    def _scatter(self, a: _Announced, staging: torch.Tensor) -> None:
        """CUDA pools: the payload landed in `staging`; copy it into its blocks."""
        shape = (a.n_layers, 2, len(a.ids), *self._pool.shape[3:])
        payload = staging.view(self._pool.dtype).view(shape)
        index = torch.tensor(a.ids, dtype=torch.long).to(self._pool.device)
        with torch.cuda.stream(self._scatter_stream):
            for i in range(a.n_layers):
                self._pool[a.layer + i].index_copy_(1, index, payload[i])
        self._scatter_stream.synchronize()  # the blocks are complete before anyone reads them

    def _account(self, t: _Transfer, a: _Announced) -> None:
        now = time.monotonic()
        stats = t.stats
        stats.bytes += a.nbytes
        stats.messages += 1
        stats.first_message_at = stats.first_message_at or now
        stats.last_message_at = now
        self.bytes_received_total += a.nbytes
        for layer in range(a.layer, a.layer + a.n_layers):
            t.layer_missing[layer] -= len(a.ids)
            if t.layer_missing[layer] == 0:
                stats.layer_completed_at[layer] = now
        t.missing -= len(a.ids) * a.n_layers
        if t.missing == 0:
            self._complete(t)
        elif a.last:
            self._fail(
                t,
                TransferError(
                    f"transfer {t.transfer_id:#x}: sender's last message arrived with "
                    f"{t.missing} (layer, block) pairs missing"
                ),
            )
            return
        # Last, so that a callback that cancels its own transfer finds consistent state.
        self._fire_layer_callbacks(t)

    def _fire_layer_callbacks(self, t: _Transfer) -> None:
        layers = self._layout.num_layers
        while (
            t.state is not _State.FAILED
            and t.next_layer_callback < layers
            and t.layer_missing[t.next_layer_callback] == 0
        ):
            layer = t.next_layer_callback
            t.next_layer_callback += 1
            if t.on_layer is None:
                continue
            try:
                t.on_layer(layer)
            except Exception:  # a caller's bug must not break the receiver
                log.exception("on_layer(%d) of transfer %#x raised", layer, t.transfer_id)

    # ---- teardown -----------------------------------------------------------------------------
    def _complete(self, t: _Transfer) -> None:
        t.state = _State.COMPLETE
        t.stats.completed_at = time.monotonic()
        self.completed_total += 1
        self._retire(t)
        t.done.set_result(t.stats)

    def _fail(self, t: _Transfer, error: TransferError) -> None:
        if t.state is not _State.LIVE:
            return
        t.state = _State.FAILED
        self.failed_total += 1
        for probe in t.early.values():
            self._drop(probe, proto.REJECT_LATE)
        t.early.clear()
        t.announced.clear()
        self._retire(t)
        if t.writing:
            self._fenced[t.transfer_id] = t
        t.done.set_exception(error)
        t.done.exception()  # marks it retrieved: nobody may be waiting

    def _retire(self, t: _Transfer) -> None:
        if t.deadline is not None:
            t.deadline.cancel()
            t.deadline = None
        expiry = time.monotonic() + _TOMBSTONE_TTL_S
        for tag in t.tags:
            self._payload_tags.pop(tag, None)
            self._dead[tag] = expiry
        t.tags.clear()
        del self._live[t.transfer_id]
        self._finished[t.transfer_id] = t
        self._dead[t.transfer_id] = expiry
        if t.writing == 0:
            self._unfence(t)

    def _unfence(self, t: _Transfer) -> None:
        self._fenced.pop(t.transfer_id, None)
        if not t.quiesced.done():
            t.quiesced.set_result(None)

    def _forget_tag(self, t: _Transfer, tag: int) -> None:
        t.tags.pop(tag, None)
        self._payload_tags.pop(tag, None)
        self._dead[tag] = time.monotonic() + _TOMBSTONE_TTL_S

    def _set_deadline(self, t: _Transfer, timeout: float) -> None:
        when = self._loop.time() + max(0.0, timeout)
        if t.deadline is not None and t.deadline.when() <= when:
            return
        if t.deadline is not None:
            t.deadline.cancel()
        t.deadline = self._loop.call_at(when, self._on_deadline, t, timeout)

    def _on_deadline(self, t: _Transfer, timeout: float) -> None:
        t.deadline = None
        total = len(t.block_ids) * self._layout.num_layers
        self._fail(
            t,
            TransferTimeout(
                f"transfer {t.transfer_id:#x} ({t.request_id}) timed out after {timeout:.3g}s: "
                f"{t.missing} of {total} (layer, block) pairs missing, "
                f"{t.stats.messages} messages landed"
            ),
        )

    # ---- helpers ------------------------------------------------------------------------------
    def _count_reject(self, reason: str) -> None:
        self.rejected_total += 1
        self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1

    def _check_block_ids(self, ids: tuple[int, ...]) -> None:
        if not ids:
            raise ValueError("a transfer needs at least one block")
        if len(set(ids)) != len(ids):
            raise ValueError("block_ids contain duplicates")
        num_blocks = self._pool.shape[2]
        bad = [b for b in ids if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:8]} outside the pool's {num_blocks} blocks")

    def _new_transfer_id(self) -> int:
        while True:
            transfer_id = secrets.randbits(64)
            taken = (
                transfer_id in self._live
                or transfer_id in self._dead
                or transfer_id in self._payload_tags
            )
            if transfer_id and not taken:
                return transfer_id

    def _expire_tombstones(self) -> None:
        now = time.monotonic()
        while self._dead:
            key, expiry = next(iter(self._dead.items()))
            if expiry > now and len(self._dead) <= _TOMBSTONE_MAX:
                break
            self._dead.popitem(last=False)
            self._finished.pop(key, None)  # never collected: let it go


def _check_pool(kv_pool: torch.Tensor, layout: KvLayout) -> None:
    if kv_pool.dim() != 6 or tuple(kv_pool.shape) != layout.pool_shape(kv_pool.shape[2]):
        raise ValueError(
            f"kv_pool shape {tuple(kv_pool.shape)} does not match layout {layout.describe()}"
        )
    if kv_pool.dtype != layout.torch_dtype:
        raise ValueError(f"kv_pool dtype {kv_pool.dtype} does not match layout {layout.dtype}")
    if not kv_pool.is_contiguous():
        raise ValueError("kv_pool must be contiguous")


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
