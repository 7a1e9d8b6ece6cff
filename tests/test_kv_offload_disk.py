"""The disk tier below host memory (shared/engine/connector/disk_tier.py) on a real engine: it
survives a restart (a fresh engine over the same directory loads a conversation's blocks from
it), a corrupted, truncated or foreign block file is detected, counted and recomputed with the
same greedy output, and an unusable directory degrades to recompute."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from shared.engine.core import EngineCore
from shared.engine.resources.block_manager import compute_block_hashes
from shared.engine.roles.decode_role import DecodeSettings
from tests.test_kv_offload import MIB, config, conversation, offload, run_turns, tier_of

# six conversations through a 24-block pool and an 8-block host tier: the first one's seven
# full blocks end up on disk only
HISTORY = [conversation(i) for i in range(1, 7)]
RETURN = [*conversation(1), 9]


def host_mib(core: EngineCore, blocks: int) -> float:
    return blocks * core.kv_pool.select(2, 0).numel() * core.kv_pool.element_size() / MIB


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], float]:
    """What a fresh engine without tiers answers the returning conversation, and the MiB of an
    8-block host tier."""
    core = EngineCore(config(), role=DecodeSettings())
    outputs, _ = run_turns(core, [RETURN])
    return outputs[0], host_mib(core, 8)


def fill(directory: Path, mib: float) -> EngineCore:
    core = EngineCore(config(), role=DecodeSettings(offload=offload(directory, mib)))
    run_turns(core, HISTORY)
    disk = tier_of(core).disk
    assert disk is not None
    disk.flush()
    return core


def restart(directory: Path, mib: float) -> tuple[EngineCore, list[int], int]:
    core = EngineCore(config(), role=DecodeSettings(offload=offload(directory, mib)))
    outputs, cached = run_turns(core, [RETURN])
    return core, outputs[0], cached[0]


def block_file(core: EngineCore, i: int) -> Path:
    """The file of the returning conversation's block `i`."""
    from shared.engine.connector.offload import tier_key

    tier = tier_of(core)
    assert tier.disk is not None
    h = compute_block_hashes(RETURN, 8)[i]
    return tier.disk._path(tier_key(tier._fingerprint, h))


def test_a_restarted_engine_reuses_the_disk_tier(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    want, mib = reference
    first = fill(tmp_path, mib)
    assert all(block_file(first, i).exists() for i in range(7))
    cut_short = block_file(first, 0).with_suffix(".tmp")
    cut_short.write_bytes(b"half a block")  # a write a stop interrupted
    core, got, cached = restart(tmp_path, mib)
    assert not cut_short.exists()
    assert got == want
    assert cached == 56  # seven blocks from disk; only the last token's block computed
    stats = tier_of(core).stats
    assert stats.disk_hit_blocks == 7 and stats.loaded_blocks == 7


def test_a_stopped_engine_leaves_its_host_and_pool_blocks_on_disk(  # type: ignore[no-untyped-def]
    tmp_path: Path, reference
) -> None:
    """One conversation, nothing evicted: its blocks are in the pool (host memory holds the
    spare copies made as they were released) and none on disk until the engine stops, which
    writes them there for the next start."""
    want, mib = reference
    first = EngineCore(config(), role=DecodeSettings(offload=offload(tmp_path, mib)))
    run_turns(first, [HISTORY[0]])
    tier = tier_of(first)
    assert tier.disk is not None and len(tier.disk) == 0 and tier.stats.offloaded_blocks == 7
    assert first.shutdown()  # conservation holds through it
    assert len(tier.disk) == 7 and tier.stats.persisted_blocks == 7
    assert all(block_file(first, i).exists() for i in range(7))
    core, got, cached = restart(tmp_path, mib)
    assert got == want and cached == 56
    assert tier_of(core).stats.disk_hit_blocks == 7
    # the seven were already there: only the returning turn's new full block is written
    assert core.shutdown() and tier_of(core).stats.persisted_blocks == 1


@pytest.mark.parametrize(
    ("damage", "good_blocks"),
    [("corrupt", 3), ("truncate", 3), ("foreign", 3), ("truncate-header", 0)],
)
def test_a_damaged_block_file_is_recomputed(  # type: ignore[no-untyped-def]
    tmp_path: Path, reference, damage: str, good_blocks: int
) -> None:
    want, mib = reference
    first = fill(tmp_path, mib)
    victim = block_file(first, good_blocks)
    data = bytearray(victim.read_bytes())
    if damage == "corrupt":
        data[-5] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[:-100]))
    elif damage == "foreign":
        shutil.copyfile(block_file(first, 6), victim)
    else:
        victim.write_bytes(bytes(data[:10]))
    core, got, cached = restart(tmp_path, mib)
    assert got == want
    tier = tier_of(core)
    assert tier.disk is not None
    assert cached == good_blocks * 8  # the blocks before the damaged one only
    assert tier.disk.stats.invalid_blocks == 1
    assert not victim.exists()  # removed: never read again


def test_an_unusable_directory_degrades_to_recompute(  # type: ignore[no-untyped-def]
    tmp_path: Path, reference, caplog: pytest.LogCaptureFixture
) -> None:
    want, mib = reference
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with caplog.at_level(logging.ERROR):
        core = EngineCore(config(), role=DecodeSettings(offload=offload(not_a_dir / "kv", mib)))
        outputs, _ = run_turns(core, [*HISTORY, RETURN])
    assert outputs[-1] == want
    assert "unusable" in caplog.text and "recomputed" in caplog.text


def test_a_directory_gone_at_run_time_is_counted_and_logged(  # type: ignore[no-untyped-def]
    tmp_path: Path, reference, caplog: pytest.LogCaptureFixture
) -> None:
    """Writes that fail (the directory removed under the node: as a full disk does) are
    logged once, counted, and the blocks recomputed when needed."""
    want, mib = reference
    directory = tmp_path / "kv"
    core = EngineCore(config(), role=DecodeSettings(offload=offload(directory, mib)))
    shutil.rmtree(directory)
    with caplog.at_level(logging.ERROR):
        outputs, _ = run_turns(core, [*HISTORY, RETURN])
        disk = tier_of(core).disk
        assert disk is not None
        disk.flush()
    assert outputs[-1] == want
    assert disk.stats.write_errors > 0 and disk.stats.written_blocks == 0
    assert caplog.text.count("unwritable") == 1
