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

from shared.kv_cache import KvLayout
from transfer import protocol as proto
from transfer import ucp
from transfer.engine import UcxEngine, UCXError
from transfer.errors import TransferError, TransferTimeout
from transfer.protocol import TransferDestination
from transfer.ucp import UcpError

log = logging.getLogger(__name__)

DEFAULT_SEND_TIMEOUT_S = 30.0
SEND_WINDOW = 8  # messages in flight per transfer (the receiver registers SEQ_WINDOW ahead)
_CLOSE_TIMEOUT_S = 2.0
_TRANSPORT_ERRORS = (UCXError, UcpError)

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
    ) -> asyncio.Future[int]:
        """Start pushing kv_pool[layer][:, src_block_ids] into dest's `dest_block_ids` (block i
        to block i); the future gives the payload bytes once UCX has sent them, or raises
        like `send`. CPU pools are read in place until then; CUDA pools are packed first."""
        if kv_pool.is_cuda:
            return self.post(
                dest, layer, dest_block_ids, self.pack(kv_pool, layer, src_block_ids), last, timeout
            )
        src = tuple(int(b) for b in src_block_ids)
        ids = self._check_ids(dest, layer, dest_block_ids)
        if len(src) != len(ids):
            raise ValueError(f"{len(src)} source blocks for {len(ids)} destination blocks")
        return self._post(
            dest, layer, ids, ucp.pool_iov(kv_pool, layer, src), kv_pool, last, timeout
        )

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
    ) -> int:
        """`send` for blocks still in the pool (see `post_blocks`)."""
        return await self.post_blocks(
            dest, layer, dest_block_ids, kv_pool, src_block_ids, last, timeout
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
            fut.add_done_callback(_consume)
        if closing:
            await asyncio.wait(closing, timeout=_CLOSE_TIMEOUT_S)
        engine.close()

    # ---- internals ----------------------------------------------------------------------------
    def _check_ids(
        self, dest: TransferDestination, layer: int, dest_block_ids: Sequence[int]
    ) -> tuple[int, ...]:
        if dest.layout_fingerprint != self._fingerprint:
            raise TransferError(
                f"KV layout mismatch: decode node {dest.layout_fingerprint}, this node "
                f"{self._fingerprint} ({self._layout.describe()})"
            )
        if not 0 <= layer < self._layout.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self._layout.num_layers - 1}")
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
    ) -> asyncio.Future[int]:
        """Post header + payload now (or, for a CUDA pack, once its copy has finished)."""
        engine = self._ensure_engine(source.device)
        out = self._transfers.setdefault(dest.transfer_id, _Outgoing())
        seq = out.next_seq
        out.next_seq += 1
        nbytes = len(ids) * self._layout.block_bytes_per_layer
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
            ),
            dtype=np.uint8,
        )
        result: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        limit = self._send_timeout if timeout is None else timeout

        async def run() -> None:
            ready = _ready_events.get(source) if iov is None else None
            if ready is not None and not ready.query():
                await asyncio.to_thread(ready.synchronize)  # UCX reads on its own streams
            peer = self._peer(engine, dest.address)
            ep = peer.endpoint
            tag = proto.payload_tag(dest.token, dest.transfer_id, seq)
            ops = [engine.send(ep, header, proto.message_tag(dest.transfer_id))]
            if iov is None:
                ops.append(engine.send(ep, source, tag))
            else:
                ops.append(engine.send_iov(ep, iov, source, tag))
            out.reading.update(ops)
            for op in ops:
                op.add_done_callback(out.reading.discard)
            try:
                # shielded: a timeout must not mark a read finished that UCX still does
                await asyncio.wait_for(asyncio.gather(*map(asyncio.shield, ops)), limit)
            except TimeoutError:
                self.errors_total += 1
                self._discard(peer)
                raise TransferTimeout(
                    f"KV send to {peer.address} (transfer {dest.transfer_id:#x}) not taken "
                    f"within {limit:.3g}s"
                ) from None
            except _TRANSPORT_ERRORS as e:
                self.errors_total += 1
                self._discard(peer)
                raise TransferError(
                    f"KV send to {peer.address} (transfer {dest.transfer_id:#x}) failed: {e}"
                ) from e
            self.bytes_sent_total += nbytes + len(header)
            self.messages_total += 1

        task = asyncio.ensure_future(run())
        task.add_done_callback(lambda t: _settle(result, t, nbytes))
        if last:
            # seq numbers are per transfer; its entry stays only while reads are outstanding
            result.add_done_callback(lambda _: self._forget_if_idle(dest.transfer_id))
        return result

    def _forget_if_idle(self, transfer_id: int) -> None:
        out = self._transfers.get(transfer_id)
        if out is not None and not out.reading:
            del self._transfers[transfer_id]

    def _ensure_engine(self, device: torch.device) -> UcxEngine:
        if self._closed:
            raise TransferError("KvSender is closed")
        if self._engine is None:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # UCX needs the CUDA context current here
            self._engine = UcxEngine()
        return self._engine

    def _peer(self, engine: UcxEngine, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is not None and peer.broken:
            self._discard(peer)
            peer = None
        if peer is None:
            host, port = proto.split_address(address)
            try:
                endpoint = engine.connect(host, port)
            except _TRANSPORT_ERRORS as e:
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
            self._engine.close_endpoint(peer.endpoint).add_done_callback(_consume)


def _settle(result: asyncio.Future[int], task: asyncio.Task, nbytes: int) -> None:
    if result.done():
        return
    if task.cancelled():
        result.cancel()
    elif task.exception() is not None:
        result.set_exception(task.exception())
    else:
        result.set_result(nbytes)


def _mark_broken(peer: _Peer) -> None:
    # UCX endpoint error callback (inside progress): flag only, the next send replaces it.
    peer.broken = True


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
