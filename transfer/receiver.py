"""Decode side of the KV push: a UCX listener that lands validated KV messages in the pool.

Flow of one message: the engine's progress hook probes the worker for any tagged message; its tag
is a transfer id. Messages for no live transfer, or with an impossible size, are drained and
counted without being read. The others queue on their transfer and are received, one at a time
and in arrival order, into one of that transfer's two staging buffers (on the pool's device,
allocated on first use, sized for the largest message the transfer can get: all of its blocks in
one message, never shared with another transfer). Only then is the header checked: magic
and version, transfer id, token (constant-time), then layout, layer, block ids (inside the
reservation, not landed yet for that layer) and sizes, and only a message that passes all of
that is scattered into `kv_pool[layer][:, ids]`.

The scatter runs on the receiver's one scatter thread, so that the loop receives message k+1
into the other staging buffer while message k is scattered. Messages are still validated,
scattered and accounted one at a time in arrival order (message k+1 is validated only after
message k is accounted). A staging buffer goes back to its transfer only after the scatter that
reads it has finished, and never while a receive into it is pending. A transfer that fails or is
cancelled while one of its scatters runs waits for that scatter (a few ms at most) before
`cancel`/the failure returns, so nothing writes into its blocks afterwards.

Who is blamed for a bad message: one without the transfer's token is noise (forged, garbage,
misrouted); it is dropped and counted and the transfer goes on. One with the right token comes
from the transfer's own sender, so if it is malformed the sender is broken: it is dropped and
counted and the transfer fails at once with TransferError instead of waiting for its deadline.

All methods run on the loop the receiver was started on; `on_layer` callbacks run there too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import functools
import hmac
import logging
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.kv_cache import KvLayout
from transfer import protocol as proto
from transfer.engine import UcxEngine, UCXError
from transfer.errors import ProtocolError, TransferCancelled, TransferError, TransferTimeout
from transfer.protocol import TransferDestination

log = logging.getLogger(__name__)

_TOMBSTONE_TTL_S = 600.0  # late messages for a finished transfer are reported as "late" this long
_TOMBSTONE_MAX = 100_000
_CLOSE_TIMEOUT_S = 2.0
_STAGING_BUFFERS = 2  # per transfer: receive one message while the previous one is scattered


@dataclass
class TransferStats:
    """What landed for one transfer; times are time.monotonic()."""

    transfer_id: int
    request_id: str
    num_blocks: int
    num_layers: int
    expected_at: float
    bytes: int = 0  # payload bytes written into the pool
    messages: int = 0  # accepted messages
    first_message_at: float | None = None
    last_message_at: float | None = None
    layer_completed_at: list[float | None] = field(default_factory=list)
    completed_at: float | None = None


class _State(enum.Enum):
    LIVE = "live"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(eq=False)
class _Transfer:
    transfer_id: int
    request_id: str
    token: bytes
    block_ids: tuple[int, ...]
    position: dict[int, int]  # block id -> index in block_ids
    landed: list[bytearray]  # per layer, 1 where that block has landed
    layer_missing: list[int]
    missing: int
    max_message: int
    on_layer: Callable[[int], None] | None
    done: asyncio.Future[TransferStats]
    stats: TransferStats
    state: _State = _State.LIVE
    queue: deque = field(default_factory=deque)  # (probe, length) waiting for a staging buffer
    receiving: bool = False  # a receive is pending (at most one, so arrival order is kept)
    staging: list[torch.Tensor] = field(default_factory=list)  # free staging buffers
    allocated: int = 0  # staging buffers allocated so far (at most _STAGING_BUFFERS)
    received: deque = field(default_factory=deque)  # (buffer, length) received, not validated
    scattering: concurrent.futures.Future | None = None  # the scatter in the scatter thread
    landing: torch.Tensor | None = None  # the staging buffer that scatter reads
    deadline: asyncio.TimerHandle | None = None
    next_layer_callback: int = 0


class KvReceiver:
    """Decode-side endpoint of the KV push; lives on the decode node's event loop."""

    def __init__(
        self, kv_pool: torch.Tensor, layout: KvLayout, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        _check_pool(kv_pool, layout)
        self._pool = kv_pool
        self._layout = layout
        self._fingerprint = proto.fingerprint_bytes(layout.fingerprint())
        self._block_bytes = layout.block_bytes_per_layer
        self._host = host
        self._port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: UcxEngine | None = None
        self._listener: object | None = None
        self._endpoints: dict[int, object] = {}  # id(endpoint) -> accepted endpoint
        self._live: dict[int, _Transfer] = {}
        self._finished: dict[int, _Transfer] = {}  # done, result not collected by wait() yet
        self._dead: OrderedDict[int, float] = OrderedDict()  # transfer id -> tombstone expiry
        self._sink = np.zeros(1, dtype=np.uint8)  # truncating receives of dropped messages
        self._scatter_stream: object | None = None  # torch.cuda.Stream for CUDA pools
        self._scatter_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.rejected_total = 0
        self.bytes_received_total = 0
        self.rejected_by_reason: dict[str, int] = {}
        self.completed_total = 0
        self.failed_total = 0

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Create the UCX worker on the running loop and listen on `port` (0: ephemeral).

        UCX listeners accept on every interface; `host` is the address advertised to peers."""
        if self._engine is not None:
            raise RuntimeError("KvReceiver already started")
        if self._pool.is_cuda:
            torch.cuda.set_device(self._pool.device)  # UCX needs the context current here
            self._scatter_stream = torch.cuda.Stream(self._pool.device)
        self._loop = asyncio.get_running_loop()
        self._scatter_thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kv-scatter"
        )
        engine = UcxEngine(self._loop)
        try:
            self._listener = engine.listen(self._port, self._on_endpoint)
        except UCXError as e:
            engine.close()
            self._scatter_thread.shutdown(wait=False)
            self._scatter_thread = None
            raise TransferError(f"cannot listen for KV on port {self._port}: {e}") from e
        self._engine = engine
        engine.add_hook(self._drain_unexpected)

    @property
    def address(self) -> str:
        if self._listener is None:
            raise RuntimeError("KvReceiver not started")
        return f"{self._host}:{self._listener.port}"

    async def close(self) -> None:
        """Fail live transfers (TransferCancelled), close peer endpoints, then the listener, then
        the UCX worker."""
        engine = self._engine
        if engine is None:
            return
        for t in list(self._live.values()):
            self._fail(t, TransferCancelled(f"transfer {t.transfer_id:#x}: receiver closed"))
        closing = [engine.close_endpoint(ep) for ep in self._endpoints.values()]
        self._endpoints.clear()
        for fut in closing:
            fut.add_done_callback(_consume)
        if closing:
            await asyncio.wait(closing, timeout=_CLOSE_TIMEOUT_S)
        self._listener = None
        self._engine = None
        engine.close()
        if self._scatter_thread is not None:
            self._scatter_thread.shutdown(wait=True)  # idle: every transfer has failed
            self._scatter_thread = None

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
            landed=[bytearray(len(ids)) for _ in range(layers)],
            layer_missing=[len(ids)] * layers,
            missing=len(ids) * layers,
            max_message=proto.header_size(len(ids)) + len(ids) * self._block_bytes,
            on_layer=on_layer,
            done=self._loop.create_future(),
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
        the transfer is torn down."""
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
        ignored, late messages for it are dropped."""
        t = self._live.get(transfer_id)
        if t is not None:
            self._fail(t, TransferCancelled(f"transfer {transfer_id:#x} cancelled"))
        self._finished.pop(transfer_id, None)

    @property
    def live_transfers(self) -> int:
        return len(self._live)

    # ---- UCX side -----------------------------------------------------------------------------
    def _on_endpoint(self, endpoint: object) -> None:
        # Runs inside UCX progress: only bookkeeping here. The callback gets the id, not the
        # endpoint, so that the endpoint does not keep itself alive.
        self._endpoints[id(endpoint)] = endpoint
        endpoint.set_close_callback(self._on_endpoint_closed, (id(endpoint),))

    def _on_endpoint_closed(self, key: int) -> None:
        # Inside UCX progress too; dropping the last reference closes the endpoint, which must
        # not happen in a UCX callback, so do it from the loop.
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon(self._endpoints.pop, key, None)

    def _drain_unexpected(self) -> None:
        engine = self._engine
        while engine is not None and (probe := engine.probe()) is not None:
            self._dispatch(probe)

    def _dispatch(self, probe: object) -> None:
        transfer_id = probe.sender_tag.value
        length = probe.length
        t = self._live.get(transfer_id)
        if t is None:
            dead = transfer_id in self._dead
            self._drop(probe, proto.REJECT_LATE if dead else proto.REJECT_UNKNOWN_TRANSFER)
        elif not proto.FIXED_HEADER_BYTES <= length <= t.max_message:
            self._drop(probe, proto.REJECT_BAD_LENGTH)
        else:
            t.queue.append((probe, length))
            self._pump(t)

    def _drop(self, probe: object, reason: str) -> None:
        """Count and drain an unwanted message without reading it (truncating receive)."""
        self._count_reject(reason)
        fut = self._engine.recv_probed(probe, self._sink)
        fut.add_done_callback(_consume)

    def _pump(self, t: _Transfer) -> None:
        """Post the next receive if a staging buffer is free, and land the oldest received
        message if no scatter of this transfer is running."""
        if t.state is not _State.LIVE:
            return
        if not t.receiving and t.queue and (t.staging or t.allocated < _STAGING_BUFFERS):
            probe, length = t.queue.popleft()
            if t.staging:
                buf = t.staging.pop()
            else:
                buf = torch.empty(t.max_message, dtype=torch.uint8, device=self._pool.device)
                t.allocated += 1
            t.receiving = True
            fut = self._engine.recv_probed(probe, buf[:length])
            fut.add_done_callback(functools.partial(self._on_received, t, buf, length))
        while t.state is _State.LIVE and t.scattering is None and t.received:
            buf, length = t.received.popleft()
            try:
                self._land(t, buf, length)
            except ProtocolError as e:
                self._fail(t, TransferError(f"transfer {t.transfer_id:#x}: bad KV message: {e}"))
                return
            if t.scattering is None:  # dropped as noise: the buffer is free again
                t.staging.append(buf)
        if t.state is _State.LIVE and not t.receiving and t.queue and t.staging:
            self._pump(t)  # a buffer came back: receive the next message

    def _on_received(self, t: _Transfer, buf: torch.Tensor, length: int, fut) -> None:
        t.receiving = False
        error = None if fut.cancelled() else fut.exception()
        if t.state is not _State.LIVE:
            # torn down while the message was in flight: never written
            self._count_reject(proto.REJECT_LATE)
            return
        if error is not None or fut.cancelled():
            self._count_reject(proto.REJECT_RECV_ERROR)
            self._fail(t, TransferError(f"transfer {t.transfer_id:#x}: receive failed: {error}"))
            return
        t.received.append((buf, length))
        self._pump(t)

    def _on_scattered(
        self,
        t: _Transfer,
        buf: torch.Tensor,
        prefix: proto.HeaderPrefix,
        ids: tuple[int, ...],
        cfut: concurrent.futures.Future,
    ) -> None:
        if t.scattering is not cfut:
            return  # the transfer failed meanwhile (and waited for this scatter)
        t.scattering = t.landing = None
        error = cfut.exception()
        if error is not None:
            self._fail(t, TransferError(f"transfer {t.transfer_id:#x}: scatter failed: {error}"))
            return
        if t.state is not _State.LIVE:
            return
        t.staging.append(buf)
        self._account(t, prefix, ids)
        self._pump(t)

    # ---- validation and landing ---------------------------------------------------------------
    def _land(self, t: _Transfer, buf: torch.Tensor, length: int) -> None:
        """Validate the message in buf[:length] and start its scatter (t.scattering). Raises
        ProtocolError for a message that carries the transfer's token but is malformed (the
        transfer fails); noise is counted and dropped (t.scattering stays None)."""
        head = self._header_bytes(t, buf, length)
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
            ids = self._check_message(t, prefix, head, length)
        except ProtocolError as e:
            self._count_reject(e.reason)
            raise
        t.landing = buf
        cfut = self._scatter_thread.submit(self._scatter, t, prefix, ids)
        t.scattering = cfut
        cfut.add_done_callback(
            lambda f: self._loop.call_soon_threadsafe(self._on_scattered, t, buf, prefix, ids, f)
        )

    def _header_bytes(self, t: _Transfer, buf: torch.Tensor, length: int) -> bytes:
        n = min(length, proto.header_size(len(t.block_ids)))
        head = buf[:n]
        return (head.cpu() if head.is_cuda else head).numpy().tobytes()

    def _check_message(
        self, t: _Transfer, prefix: proto.HeaderPrefix, head: bytes, length: int
    ) -> tuple[int, ...]:
        if prefix.layout_fingerprint != self._fingerprint:
            raise ProtocolError(proto.REJECT_LAYOUT)
        if not 0 <= prefix.layer < self._layout.num_layers:
            raise ProtocolError(proto.REJECT_BAD_LAYER, f"layer {prefix.layer}")
        if not 0 < prefix.n_blocks <= len(t.block_ids):
            raise ProtocolError(proto.REJECT_BAD_BLOCK, f"{prefix.n_blocks} blocks")
        expected = prefix.n_blocks * self._block_bytes
        if prefix.payload_bytes != expected or length != prefix.header_len + expected:
            raise ProtocolError(
                proto.REJECT_BAD_LENGTH,
                f"message {length} B, header says {prefix.payload_bytes} B payload, "
                f"{prefix.n_blocks} blocks need {expected} B",
            )
        ids = proto.decode_block_ids(head, prefix)
        landed = t.landed[prefix.layer]
        seen: set[int] = set()
        for b in ids:
            pos = t.position.get(b)
            if pos is None:
                raise ProtocolError(proto.REJECT_BAD_BLOCK, f"block {b} is not reserved")
            if landed[pos] or b in seen:
                raise ProtocolError(proto.REJECT_DUPLICATE, f"layer {prefix.layer} block {b}")
            seen.add(b)
        return ids

    def _scatter(self, t: _Transfer, prefix: proto.HeaderPrefix, ids: tuple[int, ...]) -> None:
        """Copy the message in t.landing into the pool; runs on the scatter thread."""
        start = prefix.header_len
        raw = t.landing[start : start + prefix.payload_bytes]
        payload = raw.view(self._pool.dtype).view(2, len(ids), *self._pool.shape[3:])
        if self._scatter_stream is None:
            _copy_blocks(self._pool[prefix.layer], ids, payload, None)
            return
        # The staging buffer is reused once this returns: the copy must be done by then.
        with torch.cuda.stream(self._scatter_stream):
            _copy_blocks(self._pool[prefix.layer], ids, payload, self._pool.device)
        self._scatter_stream.synchronize()

    def _account(self, t: _Transfer, prefix: proto.HeaderPrefix, ids: tuple[int, ...]) -> None:
        now = time.monotonic()
        stats = t.stats
        stats.bytes += prefix.payload_bytes
        stats.messages += 1
        stats.first_message_at = stats.first_message_at or now
        stats.last_message_at = now
        self.bytes_received_total += prefix.payload_bytes
        landed = t.landed[prefix.layer]
        for b in ids:
            landed[t.position[b]] = 1
        t.layer_missing[prefix.layer] -= len(ids)
        t.missing -= len(ids)
        if t.layer_missing[prefix.layer] == 0:
            stats.layer_completed_at[prefix.layer] = now
        if t.missing == 0:
            self._complete(t)
        elif prefix.last:
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
        for probe, _ in t.queue:
            self._drop(probe, proto.REJECT_LATE)
        t.queue.clear()
        for _ in t.received:
            self._count_reject(proto.REJECT_LATE)
        t.received.clear()
        if t.scattering is not None:
            # Its blocks may be handed out again as soon as this returns: let the copy finish.
            concurrent.futures.wait([t.scattering])
            t.scattering = t.landing = None
        self._retire(t)
        t.done.set_exception(error)
        t.done.exception()  # marks it retrieved: nobody may be waiting

    def _retire(self, t: _Transfer) -> None:
        if t.deadline is not None:
            t.deadline.cancel()
            t.deadline = None
        # An in-flight receive keeps its own reference; the buffers are never reused.
        t.staging = []
        del self._live[t.transfer_id]
        self._finished[t.transfer_id] = t
        self._dead[t.transfer_id] = time.monotonic() + _TOMBSTONE_TTL_S

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
            taken = transfer_id in self._live or transfer_id in self._dead
            if transfer_id and not taken:
                return transfer_id

    def _expire_tombstones(self) -> None:
        now = time.monotonic()
        while self._dead:
            transfer_id, expiry = next(iter(self._dead.items()))
            if expiry > now and len(self._dead) <= _TOMBSTONE_MAX:
                break
            self._dead.popitem(last=False)
            self._finished.pop(transfer_id, None)  # never collected: let it go


def _check_pool(kv_pool: torch.Tensor, layout: KvLayout) -> None:
    if kv_pool.dim() != 6 or tuple(kv_pool.shape) != layout.pool_shape(kv_pool.shape[2]):
        raise ValueError(
            f"kv_pool shape {tuple(kv_pool.shape)} does not match layout {layout.describe()}"
        )
    if kv_pool.dtype != layout.torch_dtype:
        raise ValueError(f"kv_pool dtype {kv_pool.dtype} does not match layout {layout.dtype}")
    if not kv_pool.is_contiguous():
        raise ValueError("kv_pool must be contiguous")


def _copy_blocks(
    layer_kv: torch.Tensor, ids: tuple[int, ...], payload: torch.Tensor, device: object
) -> None:
    """layer_kv[:, ids] = payload. CPU: numpy fancy indexing on byte views, one thread and 2-3x
    faster than index_copy_ here (which also spreads over the intra-op threads)."""
    if device is None:
        dst = layer_kv.reshape(2, layer_kv.shape[1], -1).view(torch.uint8).numpy()
        src = payload.reshape(2, len(ids), -1).view(torch.uint8).numpy()
        dst[:, np.asarray(ids, dtype=np.int64)] = src
        return
    index = torch.tensor(ids, dtype=torch.long).to(device)
    layer_kv.index_copy_(1, index, payload)


def _consume(fut: asyncio.Future) -> None:
    """Done-callback for futures nobody awaits: retrieve the exception so asyncio stays quiet."""
    if not fut.cancelled():
        fut.exception()
