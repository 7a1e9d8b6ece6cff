"""In-process P/D clusters: real gRPC servers, real UCX, one event loop (the preempt-recompute
benchmark's nodes; tests/support/cluster.py adds the tests' checks)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from decode_node.config import DecodeNodeConfig
from prefill_node.config import PrefillNodeConfig
from shared.engine.config import EngineConfig
from shared.model.loader import load_model


@dataclass
class PdCluster:
    prefills: list  # list[PrefillNode]
    decodes: list  # list[DecodeNode]

    @property
    def targets(self) -> list[str]:
        return [f"127.0.0.1:{d.port}" for d in self.decodes]


@contextlib.asynccontextmanager
async def pd_cluster(
    model: str | Path,
    *,
    num_prefill: int = 1,
    num_decode: int = 1,
    prefill_engine: EngineConfig | None = None,
    prefill_engines: Sequence[EngineConfig] = (),
    decode_engine: EngineConfig | None = None,
    decode_overrides: dict[str, object] | None = None,
    prefill_overrides: dict[str, object] | None = None,
    colocated: bool = False,
) -> AsyncIterator[PdCluster]:
    """`num_prefill` prefill nodes and `num_decode` decode nodes; `colocated`: instead, one
    colocated node (`pdserve colocated`: every prompt prefilled by its own engine, on
    `prefill_engine` when given, so a test that slows prefill slows it there too).
    `prefill_engines`: one prefill node on each config instead (nodes that differ)."""
    from decode_node.server import DecodeNode
    from prefill_node.server import PrefillNode

    # one model per node, as in separate processes: a model runs one forward at a time
    base = EngineConfig(model=str(model), num_kv_blocks=1024, max_batch_size=16)
    prefills = []
    decodes = []
    if colocated:
        num_prefill, num_decode = 0, 1
        decode_engine = prefill_engine or decode_engine
    try:
        engines = list(prefill_engines) or [prefill_engine or base] * num_prefill
        for engine in engines:
            cfg = PrefillNodeConfig(engine=engine, port=0, metrics_port=0)
            cfg = replace(cfg, **(prefill_overrides or {}))
            node = PrefillNode(cfg, load_model(str(model)))
            await node.start()
            prefills.append(node)
        targets = tuple(f"127.0.0.1:{p.port}" for p in prefills)
        for _ in range(num_decode):
            cfg = DecodeNodeConfig(
                engine=decode_engine or base,
                prefill_targets=targets,
                port=0,
                metrics_port=0,
                # the P/D path under test: every prompt goes to a prefill node (local prefill
                # and its fallback are asked for through decode_overrides)
                local_prefill_tokens=0,
                local_prefill_fallback=False,
                # the layer-wise push, the one with the most moving parts (the default, auto,
                # would push whole: these nodes share a host); tests ask for others
                push="layerwise",
                colocated=colocated,
            )
            cfg = replace(cfg, **(decode_overrides or {}))
            node = DecodeNode(cfg, load_model(str(model)))
            await node.start()
            decodes.append(node)
        yield PdCluster(prefills, decodes)
    finally:
        for node in decodes:
            await node.stop(grace=1.0)
        for node in prefills:
            await node.stop(grace=1.0)
