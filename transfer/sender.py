"""Prefill side of the KV push: packs a layer's blocks and sends them as one UCX message.

`pack` runs on the compute thread right after a layer is computed. It copies the layer's blocks
into a buffer that has room for the message header in front of the payload, so that `send`
(on the event loop) writes the header in place and hands ONE contiguous buffer to UCX: one copy
on this side, one message per (chunk, layer). A payload that did not come from `pack` (or one
already in flight to another destination) is copied into a new message buffer instead.

CPU pack buffers are recycled (a few per size): a buffer goes back to the free list only once the
caller has dropped every reference to the payload AND no send is reading it; a buffer whose send
failed is never reused (UCX may still read it). Fresh CPU memory costs page faults on first touch,
several times the copy itself; device memory is already recycled by torch's caching allocator.

Endpoints: one per decode node address, connected on first use, cached, and discarded after any
error (the next send reconnects). A dead decode node fails pending and later sends with
TransferError within milliseconds when its process is gone (the kernel resets the connection);
a host that vanishes silently is caught by the send `timeout`.

All methods but `pack` run on one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shared.kv_cache import KvLayout
from transfer import protocol as proto
from transfer.engine import UcxEngine, UCXError
from transfer.errors import TransferError, TransferTimeout
from transfer.protocol import TransferDestination

log = logging.getLogger(__name__)

DEFAULT_SEND_TIMEOUT_S = 30.0
_CLOSE_TIMEOUT_S = 2.0


@dataclass(eq=False)
class _Packed:
    buffer: torch.Tensor  # uint8: header room, then the payload the caller holds a view of
    header_room: int
    ready: object | None  # torch.cuda.Event recorded after the copy, for CUDA pools
    in_flight: bool = False
    dropped: bool = False  # the caller's payload is gone
    poisoned: bool = False  # a send of it failed: UCX may still read it, never reuse it


# payload tensor returned by pack -> its message buffer; weak so that dropped payloads go away
_packed: WeakIdKeyDictionary = WeakIdKeyDictionary()
_packed_lock = threading.Lock()  # pack runs on the compute thread, send on the loop
# free CPU pack buffers by size in bytes (guarded by _packed_lock)
_free_buffers: dict[int, list[torch.Tensor]] = {}
_FREE_PER_SIZE = 4
_FREE_MAX_BYTES = 512 << 20  # all sizes together
_free_bytes = 0


def _take_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    global _free_bytes
    if device.type == "cpu":
        with _packed_lock:
            free = _free_buffers.get(nbytes)
            if free:
                _free_bytes -= nbytes
                return free.pop()
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _recycle_locked(packed: _Packed) -> None:
    """Return packed's buffer if nobody can read it any more; call with _packed_lock held."""
    global _free_bytes
    buffer = packed.buffer
    if buffer is None or not packed.dropped or packed.in_flight or packed.poisoned:
        return
    packed.buffer = None
    if buffer.device.type != "cpu":
        return
    free = _free_buffers.setdefault(buffer.numel(), [])
    if len(free) < _FREE_PER_SIZE and _free_bytes + buffer.numel() <= _FREE_MAX_BYTES:
        free.append(buffer)
        _free_bytes += buffer.numel()


def _on_payload_dropped(packed: _Packed) -> None:
    with _packed_lock:
        packed.dropped = True
        _recycle_locked(packed)


@dataclass(eq=False)
class _Peer:
    address: str
    endpoint: object
    broken: bool = False


class KvSender:
    """Prefill-side endpoint of the KV push; lives on the prefill node's event loop."""

    def __init__(self, layout: KvLayout, send_timeout: float = DEFAULT_SEND_TIMEOUT_S) -> None:
        self._layout = layout
        self._fingerprint = layout.fingerprint()
        self._fingerprint_bytes = proto.fingerprint_bytes(self._fingerprint)
        self._send_timeout = send_timeout
        self._engine: UcxEngine | None = None
        self._closed = False
        self._peers: dict[str, _Peer] = {}
        self._copy_streams: dict[torch.device, object] = {}  # torch.cuda.Stream per device
        self.bytes_sent_total = 0
        self.messages_total = 0
        self.errors_total = 0

    @staticmethod
    def pack(kv_pool: torch.Tensor, layer: int, src_block_ids: Sequence[int]) -> torch.Tensor:
        """A contiguous copy of kv_pool[layer][:, src_block_ids], shape (2, n, block_size,
        kv_heads, head_dim), taken now so later compute cannot change what is sent. Its memory
        is recycled for later packs once it is dropped and no send reads it: keep the returned
        tensor itself (not only views of it) for as long as you read it."""
        n = len(src_block_ids)
        room = proto.header_size(n)
        layer_kv = kv_pool[layer]
        payload_bytes = layer_kv[:, :1].numel() * n * kv_pool.element_size()
        buffer = _take_buffer(room + payload_bytes, kv_pool.device)
        out = buffer[room:].view(kv_pool.dtype).view(2, n, *kv_pool.shape[3:])
        index = torch.tensor(list(src_block_ids), dtype=torch.long).to(kv_pool.device)
        torch.index_select(layer_kv, 1, index, out=out)
        ready = None
        if kv_pool.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(kv_pool.device))
        packed = _Packed(buffer, room, ready)
        with _packed_lock:
            _packed[out] = packed
        weakref.finalize(out, _on_payload_dropped, packed)
        return out

    async def send(
        self,
        dest: TransferDestination,
        layer: int,
        dest_block_ids: Sequence[int],
        payload: torch.Tensor,
        last: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Push one layer's blocks into dest's blocks `dest_block_ids` (payload block i goes to
        dest_block_ids[i]). `last` marks the final message of the whole transfer. Returns the
        bytes sent (header included). Raises TransferError if the layouts differ or the decode
        node is gone, TransferTimeout if it does not take the message within `timeout`
        (default: the sender's send_timeout), ValueError if the payload does not fit the
        layout. A message for a transfer the decode node already dropped is drained and
        counted there, and succeeds here: cancellation travels over gRPC, not this plane."""
        ids = tuple(int(b) for b in dest_block_ids)
        self._check(dest, layer, ids, payload)
        engine = self._ensure_engine(payload.device)
        header = proto.encode_header(
            dest.transfer_id,
            dest.token,
            self._fingerprint_bytes,
            layer,
            ids,
            payload.numel() * payload.element_size(),
            last,
        )
        message, packed = self._message_buffer(payload, header)
        await self._wait_ready(packed)
        self._write_header(message, header)
        try:
            peer = self._peer(engine, dest.address)
            await self._send_message(engine, peer, dest, message, timeout)
        except BaseException:
            # After a failure UCX may still read the buffer: a retry of the same payload gets
            # a copy instead, and the buffer is never recycled.
            if packed is not None:
                with _packed_lock:
                    packed.poisoned = True
            raise
        # Only now may the buffer's header be rewritten (or the buffer be recycled).
        if packed is not None:
            with _packed_lock:
                packed.in_flight = False
                _recycle_locked(packed)
        self.bytes_sent_total += message.numel()
        self.messages_total += 1
        return message.numel()

    async def close(self) -> None:
        """Close every endpoint (bounded wait), then the UCX worker."""
        self._closed = True
        engine = self._engine
        if engine is None:
            return
        self._engine = None
        closing = [engine.close_endpoint(p.endpoint) for p in self._peers.values()]
        self._peers.clear()
        for fut in closing:
            fut.add_done_callback(_consume)
        if closing:
            await asyncio.wait(closing, timeout=_CLOSE_TIMEOUT_S)
        engine.close()

    # ---- internals ----------------------------------------------------------------------------
    def _check(
        self, dest: TransferDestination, layer: int, ids: tuple[int, ...], payload: torch.Tensor
    ) -> None:
        if dest.layout_fingerprint != self._fingerprint:
            raise TransferError(
                f"KV layout mismatch: decode node {dest.layout_fingerprint}, this node "
                f"{self._fingerprint} ({self._layout.describe()})"
            )
        layout = self._layout
        if not 0 <= layer < layout.num_layers:
            raise ValueError(f"layer {layer} outside 0..{layout.num_layers - 1}")
        shape = (2, len(ids), layout.block_size, layout.num_kv_heads, layout.head_dim)
        if tuple(payload.shape) != shape or payload.dtype != layout.torch_dtype:
            raise ValueError(
                f"payload {tuple(payload.shape)} {payload.dtype} does not match "
                f"{shape} {layout.torch_dtype} for {len(ids)} blocks"
            )
        if not ids:
            raise ValueError("a KV message needs at least one block")

    def _ensure_engine(self, device: torch.device) -> UcxEngine:
        if self._closed:
            raise TransferError("KvSender is closed")
        if self._engine is None:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # UCX needs the CUDA context current here
            self._engine = UcxEngine()
        return self._engine

    def _message_buffer(
        self, payload: torch.Tensor, header: bytes
    ) -> tuple[torch.Tensor, _Packed | None]:
        with _packed_lock:
            packed = _packed.get(payload)
            if packed is not None and not packed.in_flight and packed.header_room == len(header):
                packed.in_flight = True
                return packed.buffer, packed
        # Not from pack (or busy): one more copy, into a buffer with header room.
        message = torch.empty(
            len(header) + payload.numel() * payload.element_size(),
            dtype=torch.uint8,
            device=payload.device,
        )
        with self._copy_stream(payload.device):
            message[len(header) :].view(payload.dtype).view(payload.shape).copy_(payload)
        self._sync_copy_stream(payload.device)
        return message, None

    async def _wait_ready(self, packed: _Packed | None) -> None:
        # UCX reads device memory on its own streams: the pack kernel must have finished.
        if packed is None or packed.ready is None or packed.ready.query():
            return
        await asyncio.to_thread(packed.ready.synchronize)

    def _write_header(self, message: torch.Tensor, header: bytes) -> None:
        src = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        with self._copy_stream(message.device):
            message[: len(header)].copy_(src)
        self._sync_copy_stream(message.device)

    def _copy_stream(self, device: torch.device) -> contextlib.AbstractContextManager:
        if device.type != "cuda":
            return contextlib.nullcontext()
        stream = self._copy_streams.get(device)
        if stream is None:
            stream = self._copy_streams[device] = torch.cuda.Stream(device)
        return torch.cuda.stream(stream)

    def _sync_copy_stream(self, device: torch.device) -> None:
        if device.type == "cuda":
            self._copy_streams[device].synchronize()

    def _peer(self, engine: UcxEngine, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is not None and peer.broken:
            self._discard(peer)
            peer = None
        if peer is None:
            host, port = proto.split_address(address)
            try:
                endpoint = engine.connect(host, port)
            except UCXError as e:
                self.errors_total += 1
                raise TransferError(f"cannot connect to decode node {address}: {e}") from e
            peer = _Peer(address, endpoint)
            endpoint.set_close_callback(_mark_broken, (peer,))
            self._peers[address] = peer
        return peer

    async def _send_message(
        self,
        engine: UcxEngine,
        peer: _Peer,
        dest: TransferDestination,
        message: torch.Tensor,
        timeout: float | None,
    ) -> None:
        limit = self._send_timeout if timeout is None else timeout
        try:
            future = engine.send(peer.endpoint, message, proto.message_tag(dest.transfer_id))
            await asyncio.wait_for(future, limit)
        except TimeoutError:
            self.errors_total += 1
            self._discard(peer)
            raise TransferTimeout(
                f"KV send to {peer.address} (transfer {dest.transfer_id:#x}) not taken within "
                f"{limit:.3g}s"
            ) from None
        except UCXError as e:
            self.errors_total += 1
            self._discard(peer)
            raise TransferError(
                f"KV send to {peer.address} (transfer {dest.transfer_id:#x}) failed: {e}"
            ) from e

    def _discard(self, peer: _Peer) -> None:
        """Forget a failed endpoint; its close runs in the background."""
        if self._peers.get(peer.address) is not peer:
            return  # already discarded
        del self._peers[peer.address]
        peer.broken = True
        if self._engine is not None:
            self._engine.close_endpoint(peer.endpoint).add_done_callback(_consume)


def _mark_broken(peer: _Peer) -> None:
    # UCX endpoint error callback (inside progress): flag only, the next send replaces it.
    peer.broken = True


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
