"""Prefill side of the KV push: one header + one payload message per (chunk, layer run).

`push = sender.open(dest, kv_pool)` starts one transfer; `push.post(KvMessage(...))` /
`await push.send(...)` send messages; `await push.quiesce(timeout)` waits until UCX no longer
reads for it. A message of pool blocks (`src`, CPU pools) is one UCX message gathered from the
blocks by an iov list (`transfer.span_cache`), so this side makes no copy of its own; the
caller keeps those blocks unchanged and allocated until the send completes (the prefill node pins
them). CUDA pools, and payloads a caller packed itself (`KvSender.pack`), go as one contiguous
buffer; the pack's CUDA event is waited for before UCX reads it. Each message has its own `seq`
and payload tag (`transfer.protocol`).

Endpoints: one per decode node address, connected on first use, cached, and discarded after any
error (the next send reconnects) or when a destination names another decode node instance at
that address (a restarted decode node: the old endpoint leads to a dead process). A dead decode
node fails pending and later sends with TransferError within milliseconds when its process is
gone (the kernel resets the connection); a host that vanishes silently is caught by the send
`timeout`.

All methods but `pack` run on one event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from shared.kv.layout import KvLayout
from transfer import protocol
from transfer.errors import TransferError, retrieve_exception
from transfer.protocol import TransferDestination
from transfer.send_cost import SendCost
from transfer.send_op import PeerEndpoint, Send
from transfer.span_cache import SpanCache
from transfer.worker import UCXError, UcxWorker

log = logging.getLogger(__name__)

DEFAULT_SEND_TIMEOUT_S = 30.0
SEND_WINDOW = 16  # messages in flight per transfer (the receiver registers SEQ_WINDOW ahead)
_CLOSE_TIMEOUT_S = 2.0

# payload tensor from `pack` -> the CUDA event recorded after its copy
_ready_events: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclass(frozen=True, kw_only=True)
class KvMessage:
    """What one KV message carries: `n_layers` layers, from `layer` on, of the blocks `blocks`
    of the destination. The bytes come either from the push's pool (`src`: block i of `src` goes
    to block i of `blocks`, read in place) or from a packed copy (`payload`, see `KvSender.pack`;
    one layer)."""

    layer: int
    blocks: Sequence[int]
    src: Sequence[int] | None = None
    payload: torch.Tensor | None = None
    n_layers: int = 1
    last: bool = False  # the final message of the whole transfer


@dataclass(frozen=True)
class _SameBlocks:
    """A message's block tuples (compared by identity) and their checked ids."""

    blocks: Sequence[int]
    src: Sequence[int]
    ids: tuple[int, ...]
    src_ids: tuple[int, ...]


class KvPush:
    """One transfer's sending side (`KvSender.open`): numbers its messages and tracks what UCX
    still reads. Several messages may be in flight; the receiver lands them in any order."""

    def __init__(
        self,
        sender: KvSender,
        dest: TransferDestination,
        kv_pool: torch.Tensor | None,
        mrope_delta: int = 0,
    ) -> None:
        self.sender = sender
        self.dest = dest
        self.kv_pool = kv_pool
        self.mrope_delta = mrope_delta  # in every header: the KV's positions depend on it
        self.reading: set[asyncio.Future] = set()  # UCX operations still reading our buffers
        self._next_seq = 0
        self._last: _SameBlocks | None = None  # the ids of the block tuples last named

    def post(self, message: KvMessage, *, timeout: float | None = None) -> asyncio.Future[int]:
        """Start sending `message`; the future gives its payload bytes once UCX has sent them,
        or raises like `send`. Pool blocks are read in place until then: the caller keeps them
        unchanged and allocated. CUDA pools are packed first (one layer per message)."""
        ids, iov, source = self._prepare(message)
        worker = self.sender._ensure_worker(source.device)
        seq = self._next_seq
        self._next_seq += 1
        nbytes = self.sender.layout.payload_bytes(message.n_layers, len(ids))
        header = protocol.encode_header(
            self.dest.transfer_id,
            self.dest.token,
            self.sender.fingerprint_bytes,
            message.layer,
            ids,
            nbytes,
            last=message.last,
            seq=seq,
            n_layers=message.n_layers,
            # stamped only when the decode node granted the blocks to an instance: one that
            # names none may predate instance ids and would not read a stamped header
            instance_id=self.sender.instance_id if self.dest.sender_instance else 0,
            mrope_delta=self.mrope_delta,
        )
        send = Send(
            self,
            worker,
            seq,
            np.frombuffer(header, dtype=np.uint8),
            iov,
            source,
            nbytes,
            self.sender.send_timeout if timeout is None else timeout,
            asyncio.get_running_loop().create_future(),
        )
        ready = _ready_events.get(source) if iov is None else None
        if ready is not None and not ready.query():
            # UCX reads device memory on its own streams: post once the pack's copy is done
            waiting = asyncio.ensure_future(asyncio.to_thread(ready.synchronize))
            waiting.add_done_callback(lambda _: send.start())
        else:
            send.start()
        return send.result

    async def send(self, message: KvMessage, *, timeout: float | None = None) -> int:
        """Send `message` and return its payload bytes. Raises TransferError if the decode node
        is gone, TransferTimeout if it does not take the message within `timeout` (default: the
        sender's send_timeout), ValueError if the message does not fit the layout. A message
        for a transfer the decode node already dropped is drained and counted there, and
        succeeds here: cancellation travels over gRPC, not this plane."""
        return await self.post(message, timeout=timeout)

    async def quiesce(self, timeout: float) -> bool:
        """Wait (at most `timeout`) until UCX no longer reads any buffer of this push; returns
        whether it got there. Reads that outlive it can only reach a transfer the decode node
        has already failed (and fenced), so callers may then release their blocks."""
        if not self.reading:
            return True
        _, pending = await asyncio.wait(set(self.reading), timeout=timeout)
        if pending:
            log.warning(
                "transfer %#x: %d KV sends still posted after %.3gs",
                self.dest.transfer_id,
                len(pending),
                timeout,
            )
        return not pending

    def _prepare(self, m: KvMessage) -> tuple[tuple[int, ...], np.ndarray | None, torch.Tensor]:
        """(destination ids, iov over the pool or None, the tensor UCX reads)."""
        layout = self.sender.layout
        if not (m.layer >= 0 and m.n_layers >= 1 and m.layer + m.n_layers <= layout.num_layers):
            raise ValueError(
                f"layers {m.layer}..{m.layer + m.n_layers - 1} outside 0..{layout.num_layers - 1}"
            )
        last = self._last
        if last is not None and m.blocks is last.blocks and m.src is last.src:
            ids, src = last.ids, last.src_ids
        else:
            ids = tuple(map(int, m.blocks))
            src = None if m.src is None else tuple(map(int, m.src))
            if src is not None and isinstance(m.blocks, tuple) and isinstance(m.src, tuple):
                self._last = _SameBlocks(m.blocks, m.src, ids, src)  # immutable: key by id
        if not ids:
            raise ValueError("a KV message needs at least one block")
        if (m.src is None) == (m.payload is None):
            raise ValueError("a KV message reads either `src` pool blocks or a packed `payload`")
        if src is not None:
            pool = self.kv_pool
            if pool is None:
                raise ValueError("`src` blocks need a push opened with a kv_pool")
            if len(src) != len(ids):
                raise ValueError(f"{len(src)} source blocks for {len(ids)} destination blocks")
            if not pool.is_cuda:
                spans = self.sender._spans(pool)
                return ids, spans.iov(pool.data_ptr(), m.layer, m.n_layers, src), pool
            if m.n_layers != 1:
                raise ValueError("CUDA pools push one layer per message")
            payload = KvSender.pack(pool, m.layer, src)
        else:
            payload = m.payload
        shape = layout.payload_shape(1, len(ids))[1:]
        if m.n_layers != 1 or tuple(payload.shape) != shape or payload.dtype != layout.torch_dtype:
            raise ValueError(
                f"payload {tuple(payload.shape)} {payload.dtype} x {m.n_layers} layers does not "
                f"match {shape} {layout.torch_dtype} for {len(ids)} blocks"
            )
        return ids, None, payload.contiguous()


class KvSender:
    """Prefill-side endpoint of the KV push; lives on the prefill node's event loop."""

    def __init__(
        self, layout: KvLayout, send_timeout: float = DEFAULT_SEND_TIMEOUT_S, instance_id: int = 0
    ) -> None:
        """`instance_id`: this node process's (ModelInfo.instance_id), stamped in the headers
        of pushes into blocks granted to it."""
        self.layout = layout
        self.instance_id = instance_id
        self.fingerprint_bytes = protocol.fingerprint_bytes(layout.fingerprint())
        self.send_timeout = send_timeout
        self._worker: UcxWorker | None = None
        self._closed = False
        self._peers: dict[str, PeerEndpoint] = {}
        self._span_cache: SpanCache | None = None
        self.cost = SendCost()  # fitted from this sender's completed messages
        self.bytes_sent_total = 0
        self.messages_total = 0
        self.errors_total = 0
        self.endpoints_dropped = 0  # cached for a decode node instance that was replaced

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

    def start(self, device: torch.device) -> None:
        """Create the UCX worker now (for pools on `device`) rather than inside the first push:
        that takes 5-200 ms, on the event loop, in the GIL, while the first prompt computes."""
        self._ensure_worker(device)

    def open(
        self, dest: TransferDestination, kv_pool: torch.Tensor | None = None, mrope_delta: int = 0
    ) -> KvPush:
        """A push into `dest`, reading `src` blocks from `kv_pool`, its headers carrying the
        request's `mrope_delta`. Raises TransferError if the decode node's KV layout is not this
        one, or it granted the blocks to another instance."""
        if dest.sender_instance not in (0, self.instance_id):
            raise TransferError(
                f"transfer {dest.transfer_id:#x} is granted to instance {dest.sender_instance:#x}"
                f", not this one ({self.instance_id:#x})"
            )
        if dest.layout_fingerprint != self.layout.fingerprint():
            raise TransferError(
                f"KV layout mismatch: decode node {dest.layout_fingerprint}, this node "
                f"{self.layout.fingerprint()} ({self.layout.describe()})"
            )
        if kv_pool is not None:
            self.layout.check_pool(kv_pool)
        return KvPush(self, dest, kv_pool, mrope_delta)

    async def close(self) -> None:
        """Close every endpoint (bounded wait), then the UCX worker."""
        self._closed = True
        worker = self._worker
        if worker is None:
            return
        self._worker = None
        closing = [worker.close_endpoint(p.endpoint) for p in self._peers.values()]
        self._peers.clear()
        for fut in closing:
            fut.add_done_callback(retrieve_exception)
        if closing:
            await asyncio.wait(closing, timeout=_CLOSE_TIMEOUT_S)
        worker.close()

    @property
    def min_message_bytes(self) -> int:
        """The smallest payload worth a message of its own, as measured so far (0: unknown);
        a layer-wise push holds a chunk's layers until they add up to it."""
        return self.cost.min_message_bytes

    # ---- internals ----------------------------------------------------------------------------
    def _spans(self, kv_pool: torch.Tensor) -> SpanCache:
        num_blocks = kv_pool.shape[2]
        cache = self._span_cache
        if cache is None or cache.num_blocks != num_blocks:
            self._span_cache = cache = SpanCache(self.layout, num_blocks)
        return cache

    def _ensure_worker(self, device: torch.device) -> UcxWorker:
        if self._closed:
            raise TransferError("KvSender is closed")
        if self._worker is None:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # UCX needs the CUDA context current here
            self._worker = UcxWorker()
        return self._worker

    def peer_endpoint(self, worker: UcxWorker, address: str, instance: int = 0) -> PeerEndpoint:
        peer = self._peers.get(address)
        if peer is not None and (peer.broken or (instance and peer.instance != instance)):
            if not peer.broken:
                log.info("decode node %s is a new instance: its old endpoint dropped", address)
                self.endpoints_dropped += 1
            self.discard(peer)
            peer = None
        if peer is None:
            host, port = protocol.split_address(address)
            try:
                endpoint = worker.connect(host, port)
            except UCXError as e:
                self.errors_total += 1
                raise TransferError(f"cannot connect to decode node {address}: {e}") from e
            peer = PeerEndpoint(address, endpoint, instance)
            endpoint.set_close_callback(_mark_broken, (peer,))
            self._peers[address] = peer
        return peer

    def discard(self, peer: PeerEndpoint) -> None:
        """Forget a failed endpoint; its close runs in the background."""
        if self._peers.get(peer.address) is not peer:
            return  # already discarded
        del self._peers[peer.address]
        peer.broken = True
        if self._worker is not None:
            self._worker.close_endpoint(peer.endpoint).add_done_callback(retrieve_exception)


def _mark_broken(peer: PeerEndpoint) -> None:
    # UCX endpoint error callback (inside progress): flag only, the next send replaces it.
    peer.broken = True
