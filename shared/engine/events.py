"""What an engine's role tells its node between commands, posted to the node's event loop by the
engine thread (`EngineThread(on_event=...)`). Token deltas have their own callback."""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.scheduling.transfer_admission import TransferGrant


@dataclass(frozen=True)
class Admitted:
    """A request queued for a transfer was admitted (its grant: the blocks the prefill node
    fills), or its deadline passed in the queue (`grant` None: it has ended)."""

    request_id: str
    grant: TransferGrant | None
