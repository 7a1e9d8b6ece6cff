"""Liveness cases the PdLifecycle state machine (tests/test_properties.py) found, replayed step
by step: each once left a request waiting forever with the blocks it needed free or freeable.
The machine asserts conservation and liveness itself (`drain_decode` raises when stuck)."""

from __future__ import annotations

import pytest

import tests.test_properties as properties
from tests.test_properties import PREFIXES, PdMachine


class _Draw:
    """`data.draw` for a replay: always the given request id."""

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def draw(self, strategy: object) -> str:
        return self.rid


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> PdMachine:
    monkeypatch.setattr(properties, "event", lambda *a, **k: None)  # outside a hypothesis run
    m = PdMachine()
    m.setup(bs=1, blocks=9, batch=1, budget=1, caching=False)
    return m


def test_a_transfer_with_one_output_token_may_fill_the_pool(machine: PdMachine) -> None:
    """9 prompt tokens, max_tokens 1, 9 one-token blocks: the request fits (its only token
    comes with the transfer), so admission must not ask for a 10th block for a decoded token."""
    machine.queue_for_transfer(ignore_eos=False, max_tokens=1, prompt=[*PREFIXES[0][:7], 3, 3])
    machine.bookkeeping_is_consistent()
    machine.drain_decode(tokens=[])
    machine.bookkeeping_is_consistent()
    machine.teardown()


def test_a_landed_transfer_is_not_starved_by_a_fresh_request(machine: PdMachine) -> None:
    """One seat: r2 (fresh, 7 tokens, 3 outputs) needs all 9 blocks by its end while r1, whose
    KV landed, holds one and waits. FCFS put r2 first, preempted it at its last block, and let
    it in again ahead of r1, forever; the holder now goes first and frees its blocks."""
    machine.queue_for_transfer(ignore_eos=False, max_tokens=2, prompt=[3])
    machine.add_colocated(ignore_eos=False, max_tokens=3, prompt=[*PREFIXES[0][:1], *[3] * 6])
    machine.bookkeeping_is_consistent()
    machine.complete_transfer(data=_Draw("r1"), first_token=65)
    machine.bookkeeping_is_consistent()
    machine.drain_decode(tokens=[])
    machine.bookkeeping_is_consistent()
    machine.teardown()
