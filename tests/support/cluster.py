"""The benchmarks' in-process P/D cluster with what the tests check of it: each node's /metrics
and conservation (every seat and KV block back in its pool once the cluster is idle)."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pdserve.bench.support import inprocess
from shared.serving.metrics import parse_prometheus_text


class PdCluster(inprocess.PdCluster):
    def metrics(self) -> list[dict[str, float]]:
        """Every node's /metrics, prefill nodes first."""
        out = []
        for node in [*self.prefills, *self.decodes]:
            url = f"http://127.0.0.1:{node.serving.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as resp:
                out.append(parse_prometheus_text(resp.read().decode()))
        return out

    async def assert_idle_and_conserved(self, timeout: float = 10.0) -> None:
        """Every node: zero seats and zero pinned blocks in use (via /metrics), then the
        engine's own conservation check."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            samples = await asyncio.to_thread(self.metrics)
            busy = [
                m
                for m in samples
                if m["pdserve_seats_in_use"]
                or m["pdserve_kv_blocks_pinned"]
                or m["pdserve_kv_blocks_in_use"]
            ]
            if not busy:
                break
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"nodes still hold resources: {busy}")
            await asyncio.sleep(0.05)
        for node in [*self.prefills, *self.decodes]:
            await node.thread.inspect(lambda core: core.check_conservation())


@contextlib.asynccontextmanager
async def pd_cluster(model: str | Path, **options: Any) -> AsyncIterator[PdCluster]:
    """`inprocess.pd_cluster(model, **options)`, yielded as the checked PdCluster above."""
    async with inprocess.pd_cluster(model, **options) as cluster:
        yield PdCluster(cluster.prefills, cluster.decodes)
