"""KV offload behind the connector: full blocks the prefix cache evicts go down to host memory
(and from there to local disk), and a prompt's blocks found there past the pool's own prefix hit
are loaded back into the pool instead of recomputed.

Copy-down starts when a published block is released into the prefix cache's evictable set
(`BlockManager.on_release`) and runs on a background thread (copy_down.py) while later steps
compute: a published block's bytes do not change until an eviction hands it on. The eviction
(`BlockManager.on_evict`) is the last moment they are good, since whoever allocated the block
(this step's forward, a landing push, a fork's copy) writes it next: it waits for a copy still
in flight, and copies on the spot a block that has no copy below (every host slot was pinned,
or host memory let it go since). Load-back happens in `start_load_kv`, before the step's
forward reads the blocks. Keys are the prefix hashes extended with the model, the pool
block's shape and dtype and the block size (`tier_key`), so no block is reused across
incompatible configurations.

Scheduler side: `external_tokens` counts the prompt's consecutive blocks past the local hit
that a tier holds (a disk block is read and verified then, and staged in host memory) and pins
their host slots; `after_allocate` ties them to the blocks the scheduler reserved. Only one
claim is open at a time: the scheduler (and the admission queue) call `after_allocate` right
after the `external_tokens` that made it, so a claim still open at the next call is stale (its
request was not admitted) and is let go.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.engine.connector.base import KvConnector
from shared.engine.connector.copy_down import BLOCK_DIM, CopyDown, CopyJob
from shared.engine.connector.disk_tier import DiskStats, DiskTier
from shared.engine.connector.host_tier import HostTier, Key
from shared.engine.connector.multi import MultiConnector
from shared.engine.connector.offload_config import GIB, OffloadConfig
from shared.engine.requests.request import LlmRequest
from shared.engine.resources.block_manager import BlockHash
from shared.engine.resources.resource_manager import KVCacheManager
from shared.engine.runtime.kv_budget import host_memory
from shared.engine.scheduling.scheduler import ScheduledRequest
from shared.model.step_context import LayerHook

log = logging.getLogger(__name__)


@dataclass
class OffloadStats:
    """Since start; read by the node's /metrics (shared/serving/offload_metrics.py)."""

    host_hit_blocks: int = 0
    disk_hit_blocks: int = 0
    miss_blocks: int = 0  # prompt blocks past the pool's hit found in no tier (per lookup)
    offloaded_blocks: int = 0  # released blocks copied down to host memory
    offloaded_bytes: int = 0
    offload_seconds: float = 0.0  # the background copier's time
    evict_wait_seconds: float = 0.0  # evictions waiting for a copy, or copying on the spot
    loaded_blocks: int = 0
    persisted_blocks: int = 0  # written to disk at shutdown (host memory and the pool's cache)
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    disk: DiskStats = field(default_factory=DiskStats)


@dataclass
class _Claim:
    request_id: str
    slots: list[int]


def block_bytes(block: torch.Tensor) -> bytes:
    """One block's bytes as the disk tier stores them (a copy: the block may change after)."""
    return block.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def tier_key(fingerprint: bytes, block_hash: BlockHash) -> Key:
    return hashlib.sha256(fingerprint + block_hash).digest()


def _check_host_memory(wanted: int) -> None:
    """Refuse at start a host tier the process could not hold (it is allocated and touched
    now: past the free memory, the kernel's OOM killer would end the node later instead)."""
    try:
        free = host_memory()
    except ValueError:
        return  # nothing tells what is free: the operator sized it
    if wanted > free.available:
        raise ValueError(
            f"--kv-offload-cpu-gb {wanted / GIB:g} is more than the "
            f"{free.available / GIB:.1f} GiB free ({free.source}): lower it"
        )


class OffloadConnector:
    def __init__(
        self, kv: KVCacheManager, config: OffloadConfig, stats: OffloadStats | None = None
    ):
        config.validate()
        self._kv = kv
        self._config = config
        self._bs = kv.block_size
        self.stats = OffloadStats() if stats is None else stats
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        self._pool: torch.Tensor | None = None
        self._fingerprint = b""
        self._claim: _Claim | None = None
        self._pending: dict[str, tuple[list[int], list[int]]] = {}  # rid -> (blocks, slots)
        self._copier: CopyDown | None = None
        self._copies: dict[int, tuple[CopyJob, list[Key]]] = {}  # id(job) -> job, its keys
        self._copy_of_block: dict[int, CopyJob] = {}  # pool blocks with a copy in flight
        self._copy_of_key: dict[Key, CopyJob] = {}
        kv.blocks.on_evict = self._on_evict
        kv.blocks.on_release = self._on_release

    # ---- model side: the pool and its tiers -----------------------------------------------
    def register_kv_pool(self, pool: torch.Tensor) -> None:
        block = pool.select(BLOCK_DIM, 0)
        shape = "x".join(map(str, block.shape))
        ident = f"{self._config.model_id}|{pool.dtype}|{shape}|bs={self._bs}"
        self._fingerprint = hashlib.sha256(ident.encode()).digest()
        self._pool = pool
        _check_host_memory(self._config.cpu_bytes)
        self.host = HostTier(self._config.cpu_bytes, block, self._to_disk)
        self._copier = CopyDown(pool, self.host.slots)
        if self._config.disk_dir:
            block_bytes = block.numel() * block.element_size()
            self.disk = DiskTier(
                self._config.disk_dir, self._config.disk_bytes, block_bytes, self.stats.disk
            )

    def _to_disk(self, key: Key, block: torch.Tensor) -> None:
        if self.disk is not None and key not in self.disk:
            self.disk.write(key, block_bytes(block))

    def _on_release(self, released: Sequence[tuple[int, BlockHash]]) -> None:
        """Published blocks now evictable: start copying down those host memory lacks."""
        if self.host is None or self._copier is None:
            return
        self._reap()
        blocks, slots, keys = [], [], []
        for block, block_hash in released:
            key = tier_key(self._fingerprint, block_hash)
            if key in self.host:
                continue
            # a spare copy while its block is still in the pool; the eviction makes it a real one
            slot = self.host.reserve(key)
            if slot is None:
                break  # host memory full of what the pool no longer has: copied at eviction
            blocks.append(block)
            slots.append(slot)
            keys.append(key)
        if not blocks:
            return
        job = self._copier.submit(blocks, slots)
        self._copies[id(job)] = (job, keys)
        self._copy_of_block.update(dict.fromkeys(blocks, job))
        self._copy_of_key.update(dict.fromkeys(keys, job))

    def _reap(self, wait: bool = False) -> None:
        """Settle the copies that are done (every open one, with `wait`): unpin their slots."""
        assert self.host is not None
        for job, keys in list(self._copies.values()):
            if not (wait or job.done.is_set()):
                continue
            CopyDown.wait(job)
            del self._copies[id(job)]
            for block in job.blocks:
                del self._copy_of_block[block]
            for key in keys:
                del self._copy_of_key[key]
            self.host.unpin(job.slots)
            self.stats.offloaded_blocks += len(job.blocks)
            self.stats.offloaded_bytes += len(job.blocks) * self.host.block_bytes
            self.stats.offload_seconds += job.seconds

    def _on_evict(self, evicted: Sequence[tuple[int, BlockHash]]) -> None:
        """Pool blocks leaving the prefix cache, not yet overwritten: make sure their bytes are
        below before the new owner writes them."""
        if self.host is None or self._pool is None:
            return
        start = time.perf_counter()
        for block, block_hash in evicted:
            job = self._copy_of_block.get(block)
            if job is not None:
                CopyDown.finish(job)
            key = tier_key(self._fingerprint, block_hash)
            if key in self.host:
                self.host.touch([key])  # no longer spare: the pool's copy is going
                continue
            self.stats.offloaded_blocks += 1
            self.stats.offloaded_bytes += self.host.block_bytes
            self.host.put([key], self._pool.select(BLOCK_DIM, block).unsqueeze(0))
        self._reap()
        self.stats.evict_wait_seconds += time.perf_counter() - start

    # ---- scheduler side -------------------------------------------------------------------
    def external_tokens(self, request: LlmRequest, local_tokens: int) -> int:
        self._drop_claim()
        if self.host is None or request.needs_prompt_logits:
            return 0
        hashes = request.prompt_block_hashes
        first = local_tokens // self._bs
        slots: list[int] = []
        for block_hash in hashes[first:]:
            slot = self._find(tier_key(self._fingerprint, block_hash))
            if slot is None:
                break
            self.host.pin([slot])  # nothing evicted meanwhile may take it
            slots.append(slot)
        self.stats.miss_blocks += len(hashes) - first - len(slots)
        if slots:
            self._claim = _Claim(request.request_id, slots)
        return len(slots) * self._bs

    def _find(self, key: Key) -> int | None:
        """The host slot holding `key`, read up from disk if only there."""
        assert self.host is not None
        job = self._copy_of_key.get(key)
        if job is not None:  # its copy is still on the way: the load must read it whole
            CopyDown.finish(job)
            self._reap()
        if key in self.host:
            self.host.touch([key])
            self.stats.host_hit_blocks += 1
            return self.host.slot_of(key)
        if self.disk is None or key not in self.disk:
            return None
        data = self.disk.read(key)
        if data is None:
            return None
        block = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        shaped = block.view(self.host.slots.dtype).view(self.host.slots.shape[1:])
        self.host.put([key], shaped.unsqueeze(0))
        if key not in self.host:  # every slot pinned: nowhere to stage it
            return None
        self.stats.disk_hit_blocks += 1
        return self.host.slot_of(key)

    def _drop_claim(self) -> None:
        if self._claim is not None and self.host is not None:
            self.host.unpin(self._claim.slots)
        self._claim = None

    def after_allocate(self, request: LlmRequest, blocks: Sequence[int]) -> None:
        claim = self._claim
        if claim is None or claim.request_id != request.request_id:
            raise RuntimeError(f"no tier blocks were claimed for {request.request_id}")
        self._claim = None
        assert self.host is not None
        used, unused = claim.slots[: len(blocks)], claim.slots[len(blocks) :]
        self.host.unpin(unused)
        self._pending[request.request_id] = (list(blocks), used)
        if request.num_preemptions == 0:  # usage's cached_tokens: reused from a tier too
            hit = len(self._kv.block_table(request.request_id)) - len(blocks)
            loaded = min(len(blocks) * self._bs, request.prompt_len - 1 - hit * self._bs)
            request.cached_tokens += max(loaded, 0)

    def finish_load(self, request: LlmRequest) -> None:
        raise RuntimeError("tier blocks are loaded in start_load_kv, within the step")

    def request_finished(self, request: LlmRequest) -> bool:
        return False

    def release(self, request_id: str) -> None:
        pass

    # ---- model side: load back before the forward -----------------------------------------
    def start_load_kv(self, scheduled: Sequence[ScheduledRequest]) -> None:
        self._drop_claim()
        if not self._pending:
            return
        assert self.host is not None and self._pool is not None
        start = time.perf_counter()
        for s in scheduled:
            entry = self._pending.pop(s.request.request_id, None)
            if entry is None:
                continue
            blocks, slots = entry
            index = torch.tensor(blocks, device=self._pool.device)
            source = self.host.slots[slots].to(self._pool.device, non_blocking=True)
            self._pool.index_copy_(BLOCK_DIM, index, source.movedim(0, BLOCK_DIM))
            self.host.unpin(slots)
            self.stats.loaded_blocks += len(blocks)
            self.stats.loaded_bytes += len(blocks) * self.host.block_bytes
        self.stats.load_seconds += time.perf_counter() - start

    def layer_hook(self, scheduled: Sequence[ScheduledRequest]) -> LayerHook | None:
        return None

    def wait_for_save(self) -> None:
        """Nothing: copies run in the background, and an eviction waits for its block's."""

    def offload_blocks(self) -> int:
        host = 0 if self.host is None else self.host.num_slots
        disk = self.disk.capacity if self.disk is not None and self.disk.usable else 0
        return host + disk

    def shutdown(self) -> None:
        """Before the process ends: what host memory and the pool's prefix cache hold goes to
        the disk tier (the least recently used first, so that the disk's own LRU keeps the most
        recent), within `persist_s`, so that a restarted node finds it there."""
        if self.host is not None:
            self._reap(wait=True)
        if self._copier is not None:
            self._copier.close()
            self._copier = None  # what is released from now on stays in the pool
        if self.disk is None or not self.disk.usable or self.host is None or self._pool is None:
            return
        deadline = time.monotonic() + self._config.persist_s
        pool = [(tier_key(self._fingerprint, h), b) for b, h in self._kv.blocks.cached_blocks()]
        in_pool = {key for key, _ in pool}
        sources = [(k, self.host.slots[slot]) for k, slot in self.host.items() if k not in in_pool]
        sources += [(key, self._pool.select(BLOCK_DIM, block)) for key, block in pool]
        kept = 0
        for key, block in sources:
            if key in self.disk:
                continue
            if not self.disk.write_by(key, block_bytes(block), deadline):
                break
            kept += 1
        try:
            self.disk.flush(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            log.warning(
                "KV disk tier: %d blocks not written in %.0fs", kept, self._config.persist_s
            )
            return
        self.stats.persisted_blocks += kept
        log.info("KV disk tier: %d blocks kept for the next start", kept)

    @property
    def host_bytes(self) -> int:
        return 0 if self.host is None else self.host.bytes_used

    def check_conservation(self) -> None:
        """Between steps: no host slot is still pinned for a load (or, once the copies in
        flight are done, for a copy)."""
        self._drop_claim()
        if self.host is not None:
            self._reap(wait=True)
        if self._pending:
            raise AssertionError(f"tier loads never run: {sorted(self._pending)[:10]}")
        if self.host is not None and self.host.num_pinned:
            raise AssertionError(f"{self.host.num_pinned} host KV slots still pinned")


def offload_tier(connector: KvConnector) -> OffloadConnector | None:
    """The offload tier among an engine's connectors (alone, or beside its P/D connector), if
    it has one: for what reads the tier from outside the engine (benchmarks, tests)."""
    parts = connector.connectors if isinstance(connector, MultiConnector) else [connector]
    return next((c for c in parts if isinstance(c, OffloadConnector)), None)
