"""The clusters several tests share (tests/conftest.py makes each a fixture of the same name):
starting one costs a model load per node, so the tests that can serve the same cluster do.
Importing this module loads no torch: conftest imports it before the environment is set."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tests.support.shared_cluster import Shared, SharedCluster, SharedClusters

if TYPE_CHECKING:
    from shared.engine.config import EngineConfig

# the prefill nodes' step budget: a prompt longer than this prefills in several steps
SMOLLM2_PD_CHUNK = 64


def _smollm2_engine(**options: Any) -> EngineConfig:
    """SmolLM2 on 512 KV blocks, 32 sequences at most (and `options`)."""
    from shared.engine.config import EngineConfig
    from shared.model.gguf_builtin import SMOLLM2_SPEC

    return EngineConfig(model=SMOLLM2_SPEC, num_kv_blocks=512, max_batch_size=32, **options)


def smollm2_pd() -> SharedCluster:
    """SmolLM2 on 2 prefill nodes (chunked at SMOLLM2_PD_CHUNK tokens) and a decode node with the
    HTTP API reading hermes tool calls: greedy parity, the schema corpus and tool calling."""
    from shared.model.gguf_builtin import SMOLLM2_SPEC

    http = {"http_port": 0, "tool_call_parser": "hermes"}
    return SharedCluster(
        SMOLLM2_SPEC,
        num_prefill=2,
        prefill_engine=_smollm2_engine(max_num_tokens=SMOLLM2_PD_CHUNK),
        decode_engine=_smollm2_engine(),
        decode_overrides=http,
    )


def smollm2_colocated() -> SharedCluster:
    """SmolLM2 on one colocated node prefilling in steps of SMOLLM2_PD_CHUNK tokens, as the P/D
    cluster's prefill nodes do: what P/D must answer exactly."""
    from shared.model.gguf_builtin import SMOLLM2_SPEC

    engine = _smollm2_engine(max_num_tokens=SMOLLM2_PD_CHUNK)
    return SharedCluster(
        SMOLLM2_SPEC, colocated=True, prefill_engine=engine, decode_overrides={"http_port": 0}
    )


def smollm2_up2() -> Shared:
    """`pdserve up --model smollm2 --decode 2` (one prefill node, the front door before two
    decode nodes): the streams that survive their node, over gRPC and over HTTP."""
    from tests.support.shared_up import SharedUp

    # 1,024 blocks (16k tokens, 0.7 GiB) a node instead of a tenth of the machine's memory each
    # (2.2 GiB on 22 GiB): every test here fits, and a fresh VM pays for each page first touched
    return SharedUp("--model", "smollm2", "--decode", "2", "--num-kv-blocks", "1024")


SHARED_CLUSTERS: dict[str, Callable[[], Shared]] = {
    "smollm2_pd": smollm2_pd,
    "smollm2_colocated": smollm2_colocated,
    "smollm2_up2": smollm2_up2,
}
SHARED = SharedClusters()


def shared(name: str) -> Shared:
    """A shared cluster's fixture: tests/conftest.py releases it after each test using it."""
    return SHARED.acquire(name, SHARED_CLUSTERS[name])
