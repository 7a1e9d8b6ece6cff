"""The offload tier's copy-down runs in the background (shared/engine/connector/copy_down.py):
released blocks are copied to host memory as spare copies while later steps compute, spare
copies never push out what the pool has lost, and an eviction that catches a copy still in
flight waits for it, so the copy holds the block's bytes from before the new owner wrote it."""

from __future__ import annotations

import gc
import threading

import torch

from shared.engine.connector.copy_down import CopyDown, CopyJob
from shared.engine.connector.host_tier import HostTier
from shared.engine.core import EngineCore
from shared.engine.roles.decode_role import DecodeSettings
from tests.test_kv_offload import TURNS, config, offload, run_turns, tier_of


def test_spare_copies_take_only_free_or_spare_slots() -> None:
    dropped: list[bytes] = []
    tier = HostTier(3 * 4 * 4, torch.zeros(4), lambda key, _: dropped.append(key))
    block = torch.ones(1, 4)
    tier.put([b"real"], block)
    spares = [tier.reserve(b"s1"), tier.reserve(b"s2")]
    assert None not in spares
    assert tier.reserve(b"s3") is None  # both spares pinned (copies in flight), one real block
    tier.unpin([s for s in spares if s is not None])
    # a spare's slot, silently: the newest one's, since the pool evicts its oldest releases
    # first and theirs are the copies needed soonest
    assert tier.reserve(b"s3") is not None
    assert b"s2" not in tier and b"s1" in tier and dropped == []
    tier.unpin([tier.slot_of(b"s3")])
    tier.touch([b"s1"])  # its block left the pool: a copy like any other now
    tier.put([b"new1", b"new2"], block.expand(2, 4))
    assert dropped == [b"real"]  # the spare s3 went first without a word, then the oldest real
    assert b"s1" in tier and b"new1" in tier and b"new2" in tier


def test_a_copy_holds_the_bytes_of_its_blocks() -> None:
    pool = torch.arange(2 * 2 * 6 * 3, dtype=torch.float32).view(2, 2, 6, 3)
    slots = torch.zeros(4, 2, 2, 3)
    copier = CopyDown(pool, slots)
    try:
        job = copier.submit([5, 1], [0, 3])
        CopyDown.wait(job)
        assert torch.equal(slots[0], pool[:, :, 5]) and torch.equal(slots[3], pool[:, :, 1])
        assert not slots[1].any() and not slots[2].any()
    finally:
        copier.close()


class GatedCopyDown(CopyDown):
    """A real copier whose first job starts only when the gate opens: a copy kept in flight."""

    def __init__(self, pool: torch.Tensor, slots: torch.Tensor, gate: threading.Event):
        super().__init__(pool, slots)
        self.gate = gate

    def _copy(self, job: CopyJob, after: torch.cuda.Event | None) -> None:
        assert self.gate.wait(30)
        super()._copy(job, after)


def test_an_eviction_waits_for_the_copy_in_flight() -> None:
    want, _ = run_turns(EngineCore(config(), role=DecodeSettings()), TURNS)
    core = EngineCore(config(), role=DecodeSettings(offload=offload()))
    tier = tier_of(core)
    assert tier.host is not None and tier._copier is not None and core.kv_pool is not None
    gate = threading.Event()
    tier._copier.close()
    tier._copier = GatedCopyDown(core.kv_pool, tier.host.slots, gate)
    blocks = core.kv_manager.blocks
    evict = blocks.on_evict
    caught: list[bool] = []  # per eviction: a copy of one of its blocks still in flight

    def evicting(evicted):  # type: ignore[no-untyped-def]
        caught.append(
            any(not j.done.is_set() for b, _ in evicted if (j := tier._copy_of_block.get(b)))
        )
        if caught[-1]:
            threading.Timer(0.2, gate.set).start()
        evict(evicted)

    blocks.on_evict = evicting
    # run_turns drains the copies after each turn: hold the first turn's open until evicted
    check = tier.check_conservation
    tier.check_conservation = lambda: None  # type: ignore[method-assign]
    got, cached = run_turns(core, TURNS)
    tier.check_conservation = check  # type: ignore[method-assign]
    assert caught and caught[0] and gate.is_set()
    assert got == want and cached[-1] == 56
    tier.check_conservation()
    core.check_conservation()


def copier_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "kv-copy-down" and t.is_alive()}


def test_a_discarded_engines_copier_stops() -> None:
    """The copier's thread holds no reference to the engine's pool: dropping the engine stops
    it (a node process that never calls shutdown, or a test's many engines, leak nothing)."""
    before = copier_threads()
    core = EngineCore(config(), role=DecodeSettings(offload=offload()))
    run_turns(core, TURNS[:2])
    (thread,) = copier_threads() - before
    del core
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
