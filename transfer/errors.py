"""Errors of the KV transfer plane."""

from __future__ import annotations

import asyncio


class TransferError(Exception):
    """A KV transfer failed (peer gone, bad data, ...). The transfer is torn down: nothing more is
    written for it and late messages carrying its id are dropped."""


class TransferTimeout(TransferError):
    """The transfer's deadline passed before every (layer, block) pair landed."""


class TransferReset(TransferError):
    """This receiver force-closed its KV endpoints (to end another transfer's stalled write):
    messages in flight on them may be lost, so the transfer was failed at once rather than left
    to time out. The sender is not at fault (the decode node does not mark it unhealthy); the
    retry goes to another node, since this one refuses the request id until the cancelled
    attempt has quiesced."""


class TransferSenderRestarted(TransferReset):
    """The prefill node the transfer's blocks were granted to came back as another process
    instance (a restart on the same address): what the old instance was sending will never
    come, and the new one drops no KV into blocks granted to the old one. Not the new
    instance's fault: the retry may go to it."""


class TransferCancelled(TransferError):
    """The transfer was cancelled by the caller (or the receiver closed)."""


class KvPortInUse(TransferError):
    """The KV listener cannot listen: another socket holds its port."""

    service = "ucx"

    def __init__(self, host: str, port: int) -> None:
        super().__init__(f"cannot listen for KV on {host}:{port}: the port is in use")
        self.host, self.port = host, port


class ProtocolError(ValueError):
    """A KV message failed validation; `reason` is the key counted in `rejected_by_reason`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def retrieve_exception(fut: asyncio.Future) -> None:
    """Done-callback for futures nobody awaits: retrieve the exception so asyncio stays quiet."""
    if not fut.cancelled():
        fut.exception()
