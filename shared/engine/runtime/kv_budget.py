"""How big a node's KV pool is, and the context it can then serve.

Given exactly (`--num-kv-blocks`, else `--kv-cache-mb`), the pool is that. Otherwise it is sized
after the weights are loaded, from the memory the process may still take:

- CUDA: the device's free memory (`torch.cuda.mem_get_info`), 0.9 of it by default: a GPU
  node usually owns its device, and the rest is for activations and CUDA graphs;
- CPU: the smaller of the cgroup's headroom (v2 `memory.max` minus the working set, v1
  `memory.limit_in_bytes` likewise, the tightest over the cgroup and its ancestors; the working
  set is the usage less the reclaimable `inactive_file` page cache, as the kubelet counts it)
  and the machine's `MemAvailable`, 0.1 of it by default: the nodes of a local cluster
  (`pdserve up` starts several on one machine) each read what is free when they start, and
  the prompt's activations, the tokenizer and the OS page cache of the weights need the rest.

`--kv-cache-memory-fraction` changes the fraction. A memory-sized pool never grows past what
the node's seats can use, `max_batch_size` sequences of the model's whole context: memory beyond
that could only keep more prefix cache, and on a shared machine it is another node's.

The served context (`max_model_len`) is then the smaller of the model's and what one request
can hold in the pool; an explicit `--max-model-len` the pool cannot hold is refused at start-up
with the flags that would fix it.

The sizing is pure arithmetic over numbers (`size_pool`, `served_context`); the memory readers
take their paths as parameters, so tests point them at a fake /proc and cgroup tree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.cdiv import cdiv
from shared.engine.config import EngineConfig
from shared.engine.runtime.cpu_budget import PROC_SELF, cgroup_dirs
from shared.kv.layout import KvLayout

MEMINFO = Path("/proc/meminfo")
DEFAULT_FRACTION = {"cpu": 0.1, "cuda": 0.9}
# cgroup v1 writes "no limit" as the largest page-aligned int64; anything this big is none
UNLIMITED = 1 << 60
MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class MemoryReading:
    """Bytes the process may still take, and where that number came from."""

    available: int
    source: str  # e.g. "cgroup v2 memory.max 4.0 GiB, 1.2 GiB in use"


@dataclass(frozen=True)
class PoolSize:
    """The KV pool a node allocates, and why it is that big."""

    num_blocks: int
    block_size: int  # tokens per block
    block_bytes: int  # one block over every layer
    why: str  # "--num-kv-blocks 512", "--kv-cache-mb 64", "0.1 of 20.3 GiB free (MemAvailable)"
    flag: str  # the flag that sized it: what to raise for a longer context

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def describe(self) -> str:
        return (
            f"KV pool: {self.num_blocks:,} blocks of {self.block_size} tokens = "
            f"{self.tokens:,} tokens, {self.bytes / MIB:,.0f} MiB ({self.why})"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "sized_by": self.why,
        }


def size_pool(
    *,
    num_kv_blocks: int,
    kv_cache_mb: int,
    fraction: float,
    block_bytes: int,
    block_size: int,
    max_blocks: int,
    memory: Callable[[], MemoryReading],
) -> PoolSize:
    """The pool: `num_kv_blocks` when given, else `kv_cache_mb`, else `fraction` of what
    `memory()` reads (called only then), capped at `max_blocks` (what every seat can use)."""
    if num_kv_blocks:
        why = f"--num-kv-blocks {num_kv_blocks}"
        return PoolSize(num_kv_blocks, block_size, block_bytes, why, "--num-kv-blocks")
    if kv_cache_mb:
        blocks = max(1, kv_cache_mb * MIB // block_bytes)
        why = f"--kv-cache-mb {kv_cache_mb}"
        return PoolSize(blocks, block_size, block_bytes, why, "--kv-cache-mb")
    reading = memory()
    share = int(reading.available * fraction)
    blocks = max(1, share // block_bytes)
    why = f"--kv-cache-memory-fraction {fraction:g} of {reading.available / GIB:.1f} GiB free"
    why += f" ({reading.source})"
    if blocks > max_blocks:
        blocks = max_blocks
        why += f", capped at max_batch_size sequences of the model's context ({max_blocks} blocks)"
    return PoolSize(blocks, block_size, block_bytes, why, "--kv-cache-memory-fraction")


def engine_pool(
    config: EngineConfig,
    layout: KvLayout,
    device: torch.device,
    model_context: int,
    memory: Callable[[], MemoryReading] | None = None,
) -> PoolSize:
    """The pool an engine on `device` allocates for `config`, its weights already loaded;
    `memory` reads what is free (default: `node_memory(device)`)."""
    fraction = config.kv_cache_memory_fraction or DEFAULT_FRACTION.get(device.type, 0.1)
    return size_pool(
        num_kv_blocks=config.num_kv_blocks,
        kv_cache_mb=config.kv_cache_memory_mb,
        fraction=fraction,
        block_bytes=layout.payload_bytes(layout.num_layers, 1),
        block_size=layout.block_size,
        max_blocks=config.max_batch_size * cdiv(model_context, layout.block_size),
        memory=memory or (lambda: node_memory(device)),
    )


def served_context(model_context: int, requested: int, pool: PoolSize | None) -> int:
    """`max_model_len`: `requested` (0: the smaller of the model's context and what one request
    can hold in `pool`; None: a pool that holds prompts only, bounding no context). Raises
    ValueError naming the flags when the model or the pool cannot hold it."""
    if requested > model_context:
        raise ValueError(
            f"--max-model-len {requested} exceeds the model's context of {model_context} tokens"
        )
    if pool is None:
        return requested or model_context
    # a request's last token is sampled, never written to the pool (RequestLimits counts the
    # same way): one request holds one token more than the pool
    holds = pool.tokens + 1
    if not requested:
        return min(model_context, holds)
    if requested > holds:
        need = cdiv(requested - 1, pool.block_size)
        fix = _pool_fix(pool, need)
        raise ValueError(
            f"--max-model-len {requested} needs {need:,} KV blocks for one request, but the KV "
            f"pool holds {pool.num_blocks:,} ({pool.tokens:,} tokens; {pool.why}): {fix}, or "
            f"lower --max-model-len to at most {holds} (or leave it out: the node then "
            "serves what its pool holds)"
        )
    return requested


def _pool_fix(pool: PoolSize, need: int) -> str:
    if pool.flag == "--num-kv-blocks":
        return f"raise --num-kv-blocks to at least {need}"
    mib = cdiv(need * pool.block_bytes, MIB)
    if pool.flag == "--kv-cache-mb":
        return f"raise --kv-cache-mb to at least {mib}"
    return (
        f"raise --kv-cache-memory-fraction, or give the pool's size exactly with --kv-cache-mb "
        f"{mib} or --num-kv-blocks {need}"
    )


# ---- what the process may still take ------------------------------------------------------


def node_memory(
    device: torch.device, proc: Path = PROC_SELF, meminfo: Path = MEMINFO
) -> MemoryReading:
    """Free memory for the pool on `device`: the GPU's, or the host's (cgroup and machine)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return MemoryReading(free, f"cuda mem_get_info, of {total / GIB:.1f} GiB")
    return host_memory(proc, meminfo)


def host_memory(proc: Path = PROC_SELF, meminfo: Path = MEMINFO) -> MemoryReading:
    """The tighter of the cgroup's headroom and the machine's MemAvailable."""
    readings = [r for r in (cgroup_memory(proc), meminfo_available(meminfo)) if r is not None]
    if not readings:
        raise ValueError(
            "cannot tell how much memory is free (no cgroup memory limit, no /proc/meminfo): "
            "size the KV pool with --kv-cache-mb or --num-kv-blocks"
        )
    return min(readings, key=lambda r: r.available)


def meminfo_available(path: Path = MEMINFO) -> MemoryReading | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                return MemoryReading(int(value.split()[0]) * 1024, "MemAvailable")
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_memory(proc: Path = PROC_SELF) -> MemoryReading | None:
    """The least headroom over the process's memory cgroups and their ancestors (the mount
    point included); None where no level sets a limit."""
    best: MemoryReading | None = None
    for version, directory, top in cgroup_dirs("memory", proc):
        level = directory
        while True:
            reading = _level_headroom(version, level)
            if reading is not None and (best is None or reading.available < best.available):
                best = reading
            if level == top or level == level.parent or not level.is_relative_to(top):
                break
            level = level.parent
    return best


_FILES = {  # version: (limit, usage, memory.stat's reclaimable page cache)
    "v2": ("memory.max", "memory.current", "inactive_file"),
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


def _level_headroom(version: str, directory: Path) -> MemoryReading | None:
    limit_file, usage_file, inactive = _FILES[version]
    try:
        text = (directory / limit_file).read_text().strip()
        if text == "max" or int(text) >= UNLIMITED:
            return None
        limit, usage = int(text), int((directory / usage_file).read_text())
    except (OSError, ValueError):
        return None
    working_set = max(0, usage - _stat(directory / "memory.stat", inactive))
    source = (
        f"cgroup {version} {limit_file} {limit / GIB:.1f} GiB, {working_set / GIB:.1f} GiB in use"
    )
    return MemoryReading(max(0, limit - working_set), source)


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return 0
    return 0
