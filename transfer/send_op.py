"""One posted KV message (header + payload) of a push: its UCX operations, completion, errors
and deadline (`transfer.sender` posts it)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from transfer import protocol
from transfer.errors import TransferError, TransferTimeout
from transfer.protocol import TransferDestination
from transfer.send_cost import SendCost
from transfer.worker import UcxWorker


@dataclass(eq=False)
class PeerEndpoint:
    """A sender's cached endpoint to one decode node address."""

    address: str
    endpoint: object
    instance: int = 0  # the decode node instance it was connected for (0: not named)
    broken: bool = False


class Sender(Protocol):
    """What a send needs of its `KvSender` (typed here: the sender imports this module)."""

    bytes_sent_total: int
    messages_total: int
    errors_total: int
    cost: SendCost

    def peer_endpoint(self, worker: UcxWorker, address: str, instance: int = 0) -> PeerEndpoint: ...

    def discard(self, peer: PeerEndpoint) -> None: ...


class Push(Protocol):
    """What a send needs of its `KvPush`."""

    sender: Sender
    dest: TransferDestination
    reading: set[asyncio.Future]


@dataclass(eq=False)
class Send:
    """One posted message (header + payload) of a transfer: completion, errors, deadline."""

    push: Push
    worker: UcxWorker
    seq: int
    header: np.ndarray
    iov: np.ndarray | None  # None: `source` is a packed contiguous payload
    source: torch.Tensor
    nbytes: int
    limit: float
    result: asyncio.Future[int]
    pending: int = 0
    peer: PeerEndpoint | None = None
    timer: asyncio.TimerHandle | None = None
    posted_at: float = 0.0

    @property
    def _what(self) -> str:
        dest = self.push.dest
        return f"KV send to {dest.address} (transfer {dest.transfer_id:#x})"

    def start(self) -> None:
        if self.result.done():
            return  # the caller gave up while a CUDA pack was finishing
        push, worker, dest = self.push, self.worker, self.push.dest
        try:
            self.peer = peer = push.sender.peer_endpoint(
                worker, dest.address, dest.receiver_instance
            )
            ep = peer.endpoint
            tag = protocol.payload_tag(dest.token, dest.transfer_id, self.seq)
            ops = [worker.send(ep, self.header, protocol.message_tag(dest.transfer_id))]
            if self.iov is None:
                ops.append(worker.send(ep, self.source, tag))
            else:
                ops.append(worker.send_iov(ep, self.iov, self.source, tag))
        except TransferError as e:
            self.result.set_exception(e)
            return
        self.pending = len(ops)
        self.posted_at = time.monotonic()
        push.reading.update(ops)
        for op in ops:
            op.add_done_callback(push.reading.discard)
            op.add_done_callback(self._on_done)
        if not self.result.done():
            self.timer = asyncio.get_running_loop().call_later(self.limit, self._on_timeout)

    def _on_done(self, op: asyncio.Future) -> None:
        error = op.exception()  # UCX futures are never cancelled
        if self.result.done():
            return
        if error is not None:
            self._fail(TransferError(f"{self._what} failed: {error}"), error)
            return
        self.pending -= 1
        if self.pending == 0:
            if self.timer is not None:
                self.timer.cancel()
            sender = self.push.sender
            wire = self.nbytes + len(self.header)
            sender.bytes_sent_total += wire
            sender.messages_total += 1
            sender.cost.observe(wire, self.posted_at, time.monotonic())
            self.result.set_result(self.nbytes)

    def _on_timeout(self) -> None:
        if not self.result.done():
            self._fail(TransferTimeout(f"{self._what} not taken within {self.limit:.3g}s"), None)

    def _fail(self, error: TransferError, cause: BaseException | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        sender = self.push.sender
        sender.errors_total += 1
        if self.peer is not None:
            sender.discard(self.peer)
        error.__cause__ = cause
        self.result.set_exception(error)
