"""The KV offload tiers' counters on a node's /metrics (shared/engine/connector/offload.py):
read at scrape time from the stats the engine thread keeps (plain numbers: a scrape may see one
step's update half done, never a torn value)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from shared.engine.connector.offload import OffloadStats
from shared.serving.metrics import ScrapeCollector, register_scrape_counter


def register_offload_metrics(registry: CollectorRegistry, stats: OffloadStats) -> None:
    disk = stats.disk
    registry.register(
        ScrapeCollector(
            "pdserve_kv_offload_hit_blocks",
            "prompt blocks past the pool's prefix hit found in a tier, by tier (per lookup: "
            "a request that waits for blocks is looked up again)",
            lambda: {"host": stats.host_hit_blocks, "disk": stats.disk_hit_blocks},
            labelnames=("tier",),
            kind="counter",
        )
    )
    registry.register(
        ScrapeCollector(
            "pdserve_kv_offload_written_bytes",
            "KV bytes copied down into a tier (host: released by the pool; disk: from host)",
            lambda: {"host": stats.offloaded_bytes, "disk": disk.written_bytes},
            labelnames=("tier",),
            kind="counter",
        )
    )
    counters = {
        "pdserve_kv_offload_miss_blocks": (
            "prompt blocks past the pool's prefix hit found in no tier (counted per lookup)",
            lambda: stats.miss_blocks,
        ),
        "pdserve_kv_offload_loaded_bytes": (
            "KV bytes loaded back from the tiers into the pool",
            lambda: stats.loaded_bytes,
        ),
        "pdserve_kv_offload_load_seconds": (
            "time the steps spent loading tier blocks into the pool",
            lambda: stats.load_seconds,
        ),
        "pdserve_kv_offload_copy_down_seconds": (
            "time the background copier spent copying released blocks down to host memory",
            lambda: stats.offload_seconds,
        ),
        "pdserve_kv_offload_evict_wait_seconds": (
            "time the steps' evictions spent waiting for a copy in flight or copying a block "
            "host memory lacked (the copy-down's cost on the critical path)",
            lambda: stats.evict_wait_seconds,
        ),
        "pdserve_kv_offload_disk_invalid_blocks": (
            "disk block files found truncated, corrupted or foreign: removed and recomputed",
            lambda: disk.invalid_blocks,
        ),
        "pdserve_kv_offload_disk_write_errors": (
            "disk block writes that failed (disk full, directory unwritable): not kept",
            lambda: disk.write_errors,
        ),
    }
    for name, (doc, fn) in counters.items():
        register_scrape_counter(registry, name, doc, fn)
