"""The KV pool's size and the context it serves (shared/engine/runtime/kv_budget.py): exact flags,
the memory-based default read from a fake /proc/self and cgroup tree (v2 and v1, a limit on an
ancestor, reclaimable page cache, no limit at all), and `max_model_len` against the pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.runtime.kv_budget import (
    MIB,
    MemoryReading,
    PoolSize,
    cgroup_memory,
    engine_pool,
    host_memory,
    meminfo_available,
    served_context,
    size_pool,
)
from shared.model.loader import tiny_config

MOUNTINFO_V2 = "30 23 0:26 / {mnt} rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
MOUNTINFO_V1 = "32 25 0:28 / {mnt} rw,nosuid - cgroup cgroup rw,memory\n"
GIB = 1 << 30
BLOCK = 737_280  # SmolLM2 fp32: 30 layers x K,V x 16 tokens x 3 heads x 64 x 4 bytes


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    _write(proc / "cgroup", cgroup)
    _write(proc / "mountinfo", mountinfo)
    return proc


def _meminfo(tmp_path: Path, available_kib: int) -> Path:
    path = tmp_path / "meminfo"
    _write(path, f"MemTotal: 65000000 kB\nMemFree: 1000 kB\nMemAvailable: {available_kib} kB\n")
    return path


def _unused() -> MemoryReading:
    raise AssertionError("an exact size must not read memory")


def test_exact_flags_win_and_never_read_memory() -> None:
    common = {"fraction": 0.1, "block_bytes": BLOCK, "block_size": 16, "max_blocks": 10**6}
    pool = size_pool(num_kv_blocks=300, kv_cache_mb=64, memory=_unused, **common)
    assert (pool.num_blocks, pool.tokens, pool.flag) == (300, 4800, "--num-kv-blocks")
    pool = size_pool(num_kv_blocks=0, kv_cache_mb=64, memory=_unused, **common)
    assert (pool.num_blocks, pool.tokens) == (64 * MIB // BLOCK, 91 * 16) == (91, 1456)
    assert pool.why == "--kv-cache-mb 64"
    assert pool.describe() == (
        "KV pool: 91 blocks of 16 tokens = 1,456 tokens, 64 MiB (--kv-cache-mb 64)"
    )


def test_v2_limit_sizes_the_pool_from_the_cgroup_headroom(tmp_path: Path) -> None:
    mnt = tmp_path / "cg2"
    proc = _proc(tmp_path, "0::/kube/pod/ctr\n", MOUNTINFO_V2.format(mnt=mnt))
    ctr, pod = mnt / "kube" / "pod" / "ctr", mnt / "kube" / "pod"
    _write(ctr / "memory.max", "max\n")
    _write(ctr / "memory.current", f"{GIB}\n")
    _write(pod / "memory.max", f"{4 * GIB}\n")  # the pod's limit: the tightest level
    # 1.5 GiB in use, 0.5 of it reclaimable page cache (the weights' file, read once)
    _write(pod / "memory.current", f"{3 * GIB // 2}\n")
    _write(pod / "memory.stat", f"anon 123\ninactive_file {GIB // 2}\nactive_file 9\n")
    _write(mnt / "kube" / "memory.max", f"{64 * GIB}\n")
    _write(mnt / "kube" / "memory.current", f"{2 * GIB}\n")
    reading = cgroup_memory(proc)
    assert reading is not None and reading.available == 3 * GIB
    assert reading.source == "cgroup v2 memory.max 4.0 GiB, 1.0 GiB in use"
    # MemAvailable (20 GiB) is looser than the cgroup: the cgroup decides
    host = host_memory(proc, _meminfo(tmp_path, 20 * GIB // 1024))
    assert host == reading
    pool = size_pool(
        num_kv_blocks=0,
        kv_cache_mb=0,
        fraction=0.25,
        block_bytes=BLOCK,
        block_size=16,
        max_blocks=10**6,
        memory=lambda: host,
    )
    assert pool.num_blocks == (3 * GIB // 4) // BLOCK == 1092
    assert pool.flag == "--kv-cache-memory-fraction"
    assert pool.why == (
        "--kv-cache-memory-fraction 0.25 of 3.0 GiB free "
        "(cgroup v2 memory.max 4.0 GiB, 1.0 GiB in use)"
    )


def test_v1_limit_and_machine_memory_when_tighter(tmp_path: Path) -> None:
    mnt = tmp_path / "memory"
    proc = _proc(tmp_path, "4:memory:/docker/abc\n", MOUNTINFO_V1.format(mnt=mnt))
    _write(mnt / "docker" / "abc" / "memory.limit_in_bytes", f"{8 * GIB}\n")
    _write(mnt / "docker" / "abc" / "memory.usage_in_bytes", f"{2 * GIB}\n")
    _write(mnt / "docker" / "abc" / "memory.stat", f"total_inactive_file {GIB}\n")
    _write(mnt / "memory.limit_in_bytes", "9223372036854771712\n")  # the root: no limit
    reading = cgroup_memory(proc)
    assert reading is not None and reading.available == 7 * GIB
    # the machine has less free than the cgroup allows: MemAvailable decides
    host = host_memory(proc, _meminfo(tmp_path, 2 * GIB // 1024))
    assert host == MemoryReading(2 * GIB, "MemAvailable")


def test_no_limit_anywhere_reads_memavailable(tmp_path: Path) -> None:
    mnt = tmp_path / "cg2"
    proc = _proc(tmp_path, "0::/svc\n", MOUNTINFO_V2.format(mnt=mnt))
    _write(mnt / "svc" / "memory.max", "max\n")
    _write(mnt / "svc" / "memory.current", "5\n")
    assert cgroup_memory(proc) is None
    assert cgroup_memory(tmp_path / "no-proc") is None
    meminfo = _meminfo(tmp_path, 1024)
    assert meminfo_available(meminfo) == MemoryReading(1 << 20, "MemAvailable")
    assert host_memory(proc, meminfo).available == 1 << 20
    with pytest.raises(ValueError, match="--kv-cache-mb or --num-kv-blocks"):
        host_memory(proc, tmp_path / "no-meminfo")


def test_engine_pool_caps_at_every_seat_holding_the_whole_context(tmp_path: Path) -> None:
    """The engine's own sizing (config, layout, device) over the fake cgroup: a small model
    gets what its seats can use, not a share of a large machine."""
    mnt = tmp_path / "cg2"
    proc = _proc(tmp_path, "0::/n\n", MOUNTINFO_V2.format(mnt=mnt))
    _write(mnt / "n" / "memory.max", f"{16 * GIB}\n")
    _write(mnt / "n" / "memory.current", "0\n")
    layout = tiny_config().kv_layout(16, torch.float32)
    meminfo = _meminfo(tmp_path, 64 * GIB // 1024)

    def pool(**fields: object) -> PoolSize:
        config = EngineConfig(max_batch_size=4, **fields)  # type: ignore[arg-type]
        memory = lambda: host_memory(proc, meminfo)  # noqa: E731
        return engine_pool(config, layout, torch.device("cpu"), 4096, memory=memory)

    capped = pool()
    assert capped.num_blocks == 4 * 4096 // 16  # 0.1 of 16 GiB is far more
    assert "capped at max_batch_size sequences" in capped.why
    block = layout.payload_bytes(layout.num_layers, 1)
    small = pool(kv_cache_memory_fraction=1e-5)
    assert small.num_blocks == int(16 * GIB * 1e-5) // block
    assert pool(kv_cache_memory_mb=1).num_blocks == MIB // block


def test_served_context_is_what_the_pool_holds_or_a_startup_error() -> None:
    def pool(blocks: int, why: str, flag: str) -> PoolSize:
        return PoolSize(blocks, 16, BLOCK, why, flag)

    mb64 = pool(91, "--kv-cache-mb 64", "--kv-cache-mb")
    # the pool, not the model, limits it: its 1,456 tokens and a last one, sampled but never
    # written
    assert served_context(8192, 0, mb64) == 1457
    assert served_context(8192, 1000, mb64) == 1000
    assert served_context(8192, 0, pool(4096, "x", "--num-kv-blocks")) == 8192
    with pytest.raises(ValueError) as e:
        served_context(8192, 8192, mb64)
    message = str(e.value)
    assert "--max-model-len 8192 needs 512 KV blocks" in message
    assert "raise --kv-cache-mb to at least 360" in message  # 512 blocks x 720 KiB
    assert "lower --max-model-len to at most 1457" in message
    with pytest.raises(ValueError, match="raise --num-kv-blocks to at least 512"):
        served_context(8192, 8192, pool(91, "--num-kv-blocks 91", "--num-kv-blocks"))
    with pytest.raises(ValueError, match="raise --kv-cache-memory-fraction"):
        served_context(8192, 8192, pool(91, "0.1 of ...", "--kv-cache-memory-fraction"))
    with pytest.raises(ValueError, match="exceeds the model's context of 8192"):
        served_context(8192, 9000, pool(4096, "x", "--num-kv-blocks"))


def test_config_rejects_a_fraction_outside_0_1() -> None:
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig(kv_cache_memory_fraction=1.5).validate()
    with pytest.raises(ValueError, match="kv_cache_memory_mb"):
        EngineConfig(kv_cache_memory_mb=-1).validate()
