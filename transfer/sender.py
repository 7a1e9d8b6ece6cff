"""Prefill side of the KV push: one header + one payload message per (chunk, layer).

`post_blocks` sends a layer's blocks straight out of the KV pool (CPU pools): the payload is one
UCX message gathered from the blocks by an iov list (runs of adjacent blocks become one entry),
so this side makes no copy of its own; UCX copies once into its transport. The caller must keep
those blocks unchanged and allocated until the send completes (the prefill node pins them when
it queues the message). CUDA pools, and payloads a caller packed itself (`pack`), go as one
contiguous buffer; the pack's CUDA event is waited for before UCX reads the buffer.

Several messages may be in flight per transfer (each has its own `seq` and payload tag, see
`transfer.protocol`); the receiver lands them in any order. `quiesce(transfer_id)` waits until
UCX has finished reading for a transfer.

Endpoints: one per decode node address, connected on first use, cached, and discarded after any
error (the next send reconnects). A dead decode node fails pending and later sends with
TransferError within milliseconds when its process is gone (the kernel resets the connection);
a host that vanishes silently is caught by the send `timeout`.

All methods but `pack` run on one event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from shared.engine.kv_cache import KvLayout
from transfer import protocol as proto
from transfer import ucp
from transfer.errors import TransferError, TransferTimeout, retrieve_exception
from transfer.protocol import TransferDestination
from transfer.worker import UCXError, UcxWorker

log = logging.getLogger(__name__)

DEFAULT_SEND_TIMEOUT_S = 30.0
SEND_WINDOW = 16  # messages in flight per transfer (the receiver registers SEQ_WINDOW ahead)
_CLOSE_TIMEOUT_S = 2.0

# payload tensor from `pack` -> the CUDA event recorded after its copy
_ready_events: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclass(eq=False)
class _Peer:
    address: str
    endpoint: object
    broken: bool = False


@dataclass(eq=False)
class _Outgoing:
    """One transfer's sending side: the next seq and the UCX operations still reading."""

    next_seq: int = 0
    reading: set[asyncio.Future] = field(default_factory=set)


@dataclass(eq=False)
class _Send:
    """One posted message (header + payload) of a transfer: completion, errors, deadline."""

    sender: KvSender
    engine: UcxWorker
    out: _Outgoing
    dest: TransferDestination
    seq: int
    header: np.ndarray
    iov: np.ndarray | None  # None: `source` is a packed contiguous payload
    source: torch.Tensor
    nbytes: int
    limit: float
    result: asyncio.Future[int]
    pending: int = 0
    peer: _Peer | None = None
    timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self.result.done():
            return  # the caller gave up while a CUDA pack was finishing
        sender, engine, dest = self.sender, self.engine, self.dest
        try:
            self.peer = peer = sender._peer(engine, dest.address)
            ep = peer.endpoint
            tag = proto.payload_tag(dest.token, dest.transfer_id, self.seq)
            ops = [engine.send(ep, self.header, proto.message_tag(dest.transfer_id))]
            if self.iov is None:
                ops.append(engine.send(ep, self.source, tag))
            else:
                ops.append(engine.send_iov(ep, self.iov, self.source, tag))
        except TransferError as e:
            self.result.set_exception(e)
            return
        self.pending = len(ops)
        self.out.reading.update(ops)
        for op in ops:
            op.add_done_callback(self.out.reading.discard)
            op.add_done_callback(self._on_done)
        if not self.result.done():
            self.timer = asyncio.get_running_loop().call_later(self.limit, self._on_timeout)

    def _on_done(self, op: asyncio.Future) -> None:
        error = op.exception()  # engine futures are never cancelled
        if self.result.done():
            return
        if error is not None:
            self._fail(
                TransferError(
                    f"KV send to {self.dest.address} (transfer {self.dest.transfer_id:#x}) "
                    f"failed: {error}"
                ),
                error,
            )
            return
        self.pending -= 1
        if self.pending == 0:
            if self.timer is not None:
                self.timer.cancel()
            self.sender.bytes_sent_total += self.nbytes + len(self.header)
            self.sender.messages_total += 1
            self.result.set_result(self.nbytes)

    def _on_timeout(self) -> None:
        if not self.result.done():
            self._fail(
                TransferTimeout(
                    f"KV send to {self.dest.address} (transfer {self.dest.transfer_id:#x}) not "
                    f"taken within {self.limit:.3g}s"
                ),
                None,
            )

    def _fail(self, error: TransferError, cause: BaseException | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.sender.errors_total += 1
        if self.peer is not None:
            self.sender._discard(self.peer)
        error.__cause__ = cause
        self.result.set_exception(error)


class KvSender:
    """Prefill-side endpoint of the KV push; lives on the prefill node's event loop."""

    def __init__(self, layout: KvLayout, send_timeout: float = DEFAULT_SEND_TIMEOUT_S) -> None:
        self._layout = layout
        self._fingerprint = layout.fingerprint()
        self._fingerprint_bytes = proto.fingerprint_bytes(self._fingerprint)
        self._send_timeout = send_timeout
        self._engine: UcxWorker | None = None
        self._closed = False
        self._peers: dict[str, _Peer] = {}
        self._transfers: dict[int, _Outgoing] = {}
        self.bytes_sent_total = 0
        self.messages_total = 0
        self.errors_total = 0

    @staticmethod
    def pack(kv_pool: torch.Tensor, layer: int, src_block_ids: Sequence[int]) -> torch.Tensor:
        """A contiguous copy of kv_pool[layer][:, src_block_ids], shape (2, n, block_size,
        kv_heads, head_dim), taken now so later compute cannot change what is sent."""
        index = torch.tensor(list(src_block_ids), dtype=torch.long).to(kv_pool.device)
        out = torch.index_select(kv_pool[layer], 1, index)
        if kv_pool.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(kv_pool.device))
            _ready_events[out] = ready
        return out

    def post_blocks(
        self,
        dest: TransferDestination,
        layer: int,
        dest_block_ids: Sequence[int],
        kv_pool: torch.Tensor,
        src_block_ids: Sequence[int],
        last: bool = False,
        timeout: float | None = None,
        n_layers: int = 1,
    ) -> asyncio.Future[int]:
        """Start pushing kv_pool[layer : layer + n_layers][:, :, src_block_ids] into dest's
        `dest_block_ids` (block i to block i); the future gives the payload bytes once UCX has
        sent them, or raises like `send`. CPU pools are read in place until then; CUDA pools
        are packed first (one layer per message)."""
        if kv_pool.is_cuda and n_layers != 1:
            raise ValueError("CUDA pools push one layer per message")
        if kv_pool.is_cuda:
            return self.post(
                dest, layer, dest_block_ids, self.pack(kv_pool, layer, src_block_ids), last, timeout
            )
        src = tuple(int(b) for b in src_block_ids)
        ids = self._check_ids(dest, layer, dest_block_ids, n_layers)
        if len(src) != len(ids):
            raise ValueError(f"{len(src)} source blocks for {len(ids)} destination blocks")
        iov = ucp.pool_iov(kv_pool, layer, src, n_layers)
        return self._post(dest, layer, ids, iov, kv_pool, last, timeout, n_layers)

    def post(
        self,
        dest: TransferDestination,
        layer: int,
        dest_block_ids: Sequence[int],
        payload: torch.Tensor,
        last: bool = False,
        timeout: float | None = None,
    ) -> asyncio.Future[int]:
        """Start pushing a packed payload (2, n, block_size, kv_heads, head_dim)."""
        ids = self._check_ids(dest, layer, dest_block_ids)
        layout = self._layout
        shape = (2, len(ids), layout.block_size, layout.num_kv_heads, layout.head_dim)
        if tuple(payload.shape) != shape or payload.dtype != layout.torch_dtype:
            raise ValueError(
                f"payload {tuple(payload.shape)} {payload.dtype} does not match "
                f"{shape} {layout.torch_dtype} for {len(ids)} blocks"
            )
        payload = payload.contiguous()
        return self._post(dest, layer, ids, None, payload, last, timeout)

    async def send(
        self,
        dest: TransferDestination,
        layer: int,
        dest_block_ids: Sequence[int],
        payload: torch.Tensor,
        last: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Push one layer's packed blocks into dest's blocks `dest_block_ids` (payload block i
        goes to dest_block_ids[i]). `last` marks the final message of the whole transfer.
        Returns the payload bytes. Raises TransferError if the layouts differ or the decode node
        is gone, TransferTimeout if it does not take the message within `timeout` (default: the
        sender's send_timeout), ValueError if the payload does not fit the layout. A message for
        a transfer the decode node already dropped is drained and counted there, and succeeds
        here: cancellation travels over gRPC, not this plane."""
        return await self.post(dest, layer, dest_block_ids, payload, last, timeout)

    async def send_blocks(
        self,
        dest: TransferDestination,
        layer: int,
        dest_block_ids: Sequence[int],
        kv_pool: torch.Tensor,
        src_block_ids: Sequence[int],
        last: bool = False,
        timeout: float | None = None,
        n_layers: int = 1,
    ) -> int:
        """`send` for blocks still in the pool (see `post_blocks`)."""
        return await self.post_blocks(
            dest, layer, dest_block_ids, kv_pool, src_block_ids, last, timeout, n_layers
        )

    async def quiesce(self, transfer_id: int, timeout: float) -> bool:
        """Wait (at most `timeout`) until UCX no longer reads any buffer of the transfer, then
        forget it. Returns whether it got there. Reads that outlive it can only reach a
        transfer the decode node has already failed (and fenced), so callers may then release
        their blocks."""
        out = self._transfers.pop(transfer_id, None)
        if out is None or not out.reading:
            return True
        _, pending = await asyncio.wait(set(out.reading), timeout=timeout)
        if pending:
            log.warning(
                "transfer %#x: %d KV sends still posted after %.3gs",
                transfer_id,
                len(pending),
                timeout,
            )
        return not pending

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
            fut.add_done_callback(retrieve_exception)
        if closing:
            await asyncio.wait(closing, timeout=_CLOSE_TIMEOUT_S)
        engine.close()

    # ---- internals ----------------------------------------------------------------------------
    def _check_ids(
        self,
        dest: TransferDestination,
        layer: int,
        dest_block_ids: Sequence[int],
        n_layers: int = 1,
    ) -> tuple[int, ...]:
        if dest.layout_fingerprint != self._fingerprint:
            raise TransferError(
                f"KV layout mismatch: decode node {dest.layout_fingerprint}, this node "
                f"{self._fingerprint} ({self._layout.describe()})"
            )
        if not (layer >= 0 and n_layers >= 1 and layer + n_layers <= self._layout.num_layers):
            raise ValueError(
                f"layers {layer}..{layer + n_layers - 1} outside 0..{self._layout.num_layers - 1}"
            )
        ids = tuple(int(b) for b in dest_block_ids)
        if not ids:
            raise ValueError("a KV message needs at least one block")
        return ids

    def _post(
        self,
        dest: TransferDestination,
        layer: int,
        ids: tuple[int, ...],
        iov: np.ndarray | None,
        source: torch.Tensor,
        last: bool,
        timeout: float | None,
        n_layers: int = 1,
    ) -> asyncio.Future[int]:
        """Post header + payload now (or, for a CUDA pack, once its copy has finished)."""
        engine = self._ensure_engine(source.device)
        out = self._transfers.setdefault(dest.transfer_id, _Outgoing())
        seq = out.next_seq
        out.next_seq += 1
        nbytes = n_layers * len(ids) * self._layout.block_bytes_per_layer
        header = np.frombuffer(
            proto.encode_header(
                dest.transfer_id,
                dest.token,
                self._fingerprint_bytes,
                layer,
                ids,
                nbytes,
                last,
                seq,
                n_layers,
            ),
            dtype=np.uint8,
        )
        loop = asyncio.get_running_loop()
        send = _Send(
            self,
            engine,
            out,
            dest,
            seq,
            header,
            iov,
            source,
            nbytes,
            self._send_timeout if timeout is None else timeout,
            loop.create_future(),
        )
        ready = _ready_events.get(source) if iov is None else None
        if ready is not None and not ready.query():
            # UCX reads device memory on its own streams: post once the pack's copy is done
            waiting = asyncio.ensure_future(asyncio.to_thread(ready.synchronize))
            waiting.add_done_callback(lambda _: send.start())
        else:
            send.start()
        if last:
            # seq numbers are per transfer; its entry stays only while reads are outstanding
            send.result.add_done_callback(lambda _: self._forget_if_idle(dest.transfer_id))
        return send.result

    def _forget_if_idle(self, transfer_id: int) -> None:
        out = self._transfers.get(transfer_id)
        if out is not None and not out.reading:
            del self._transfers[transfer_id]

    def _ensure_engine(self, device: torch.device) -> UcxWorker:
        if self._closed:
            raise TransferError("KvSender is closed")
        if self._engine is None:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # UCX needs the CUDA context current here
            self._engine = UcxWorker()
        return self._engine

    def _peer(self, engine: UcxWorker, address: str) -> _Peer:
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

    def _discard(self, peer: _Peer) -> None:
        """Forget a failed endpoint; its close runs in the background."""
        if self._peers.get(peer.address) is not peer:
            return  # already discarded
        del self._peers[peer.address]
        peer.broken = True
        if self._engine is not None:
            self._engine.close_endpoint(peer.endpoint).add_done_callback(retrieve_exception)


def _mark_broken(peer: _Peer) -> None:
    # UCX endpoint error callback (inside progress): flag only, the next send replaces it.
    peer.broken = True
