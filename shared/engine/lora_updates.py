"""LoRA adapters loaded and unloaded while the engine serves (`LoadLora`, `UnloadLora`), on the
engine thread between two steps, so that no step sees a slot half written.

An adapter is read and checked against the base model by the caller (its files are I/O); here
it only goes into a free slot. Unloading is refused while any live request (queued, waiting
for its KV or running) names the adapter: its next step would read a slot that is gone. An
adapter loaded again under a name it had before gets KV of its own (its files' digest is in the
prefix hashes: shared/engine/info.py), so nothing it reads was computed with the old weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from shared.engine.commands import LoadLora, UnloadLora
from shared.engine.requests.request import LlmRequest
from shared.model.lora_bank import LoraBank


class LoraUpdateError(Exception):
    """A load or unload that cannot be done; `status`: the HTTP status that says why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def slots_of(bank: LoraBank | None) -> LoraBank:
    """The model's adapter slots; LoraUpdateError where it has none."""
    if bank is None:
        raise LoraUpdateError(
            400, "this node has no LoRA adapter slots: start it with --max-loras N"
        )
    return bank


class LoraUpdates:
    def __init__(self, bank: LoraBank | None, live: Callable[[], Iterable[LlmRequest]]):
        self.bank = bank
        self.live = live

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        return {LoadLora: self.load, UnloadLora: self.unload}

    def load(self, command: LoadLora) -> None:
        try:
            slots_of(self.bank).load(command.adapter)
        except ValueError as e:  # the name is taken, or every slot is
            raise LoraUpdateError(400, str(e)) from None

    def unload(self, command: UnloadLora) -> None:
        bank = slots_of(self.bank)
        if command.name not in bank.slots:
            loaded = sorted(bank.slots)
            raise LoraUpdateError(
                404, f"LoRA adapter {command.name!r} is not loaded (loaded: {loaded})"
            )
        users = sum(1 for r in self.live() if r.sampling_params.lora_adapter == command.name)
        if users:
            raise LoraUpdateError(
                400,
                f"LoRA adapter {command.name!r} is in use by {users} request(s): unload it once "
                "they have ended",
            )
        bank.unload(command.name)
