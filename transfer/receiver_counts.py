"""What a KV receiver counts and reports (its metrics and its line in the logs), apart from
the receiving itself (`transfer.receiver`). Bookkeeping only."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # read through the receiver's attributes: no UCX imported here
    from transfer.landings import Landings
    from transfer.listener import KvListener


class ReceiverCounts:
    """Counters and read-only views of a `KvReceiver`; it owns the listener, the landings
    and the count of posted writes that these read."""

    _net: KvListener | None
    _landings: Landings
    _writing: int

    def __init__(self) -> None:
        self.rejected_total = 0
        self.bytes_received_total = 0
        self.rejected_by_reason: dict[str, int] = {}
        self.completed_total = 0
        self.failed_total = 0
        self.endpoint_resets = 0  # fences broken by force-closing endpoints
        self.senders_restarted = 0  # transfers failed because their sender instance restarted

    @property
    def listener_restarts(self) -> int:
        """Restarts of the KV listener after its receive queue stuck (transfer.queue_check)."""
        return 0 if self._net is None else self._net.restarts

    @property
    def live_transfers(self) -> int:
        return len(self._landings.live)

    @property
    def fenced_transfers(self) -> int:
        """Failed transfers whose blocks a posted payload receive may still write."""
        return len(self._landings.fenced)

    @property
    def writes_in_flight(self) -> int:
        """Payload receives posted into the pool (or staging) and not completed."""
        return self._writing

    def describe(self) -> str:  # one line for logs: what this receiver holds now
        endpoints = 0 if self._net is None else self._net.num_endpoints
        return (
            f"{self.live_transfers} live, {self.fenced_transfers} fenced, {self._writing} "
            f"writes posted, {endpoints} endpoints, {self.endpoint_resets} resets, "
            f"{self.listener_restarts} listener restarts, "
            f"rejected {self.rejected_by_reason or 'none'}"
        )

    def _count_reject(self, reason: str) -> None:
        self.rejected_total += 1
        self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1
