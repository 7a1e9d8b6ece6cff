"""A colocated node started with --kv-offload-cpu-gb (in-process: real gRPC, uvicorn, torch):
a conversation the pool evicted comes back from the host tier, usage's cached_tokens counts it,
/metrics shows the tier's hits and bytes, and every block and host slot is back afterwards."""

from __future__ import annotations

import asyncio

import httpx

from decode_node.config import DecodeNodeConfig
from pdserve.cli.main import build_parser
from shared.engine.config import EngineConfig
from shared.engine.connector.offload import offload_tier
from shared.model.loader import load_model
from shared.serving.metrics import parse_prometheus_text
from tests.engine_helpers import single_torch_thread

ENGINE = EngineConfig(model="tiny", block_size=16, num_kv_blocks=24, max_batch_size=2)
# P/D: a decode pool of 24 blocks, like the prefill node's
DECODE = EngineConfig(model="tiny", block_size=16, num_kv_blocks=24, max_batch_size=2)
CONVERSATIONS = [[(seed * 37 + 11 * i) % 250 + 5 for i in range(150)] for seed in range(1, 5)]


def test_the_flags_reach_the_node_config() -> None:
    flags = ["--kv-offload-cpu-gb", "0.5", "--kv-offload-disk-dir", "/d"]
    a = build_parser().parse_args(["colocated", *flags, "--kv-offload-disk-gb", "2"])
    assert (a.kv_offload_cpu_gb, a.kv_offload_disk_dir, a.kv_offload_disk_gb) == (0.5, "/d", 2)


async def _complete(client: httpx.AsyncClient, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def _run(cpu_gb: float) -> tuple[list[str], list[int], dict[str, float]]:
    from decode_node.server import DecodeNode

    cfg = DecodeNodeConfig(
        engine=ENGINE,
        colocated=True,
        port=0,
        metrics_port=0,
        http_port=0,
        kv_offload_cpu_gb=cpu_gb,
    )
    node = DecodeNode(cfg, load_model("tiny"))
    await node.start()
    try:
        texts, cached = [], []
        url = f"http://127.0.0.1:{node.http_port}"
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            for prompt in [*CONVERSATIONS, [*CONVERSATIONS[0], 7]]:
                out = await _complete(client, prompt)
                texts.append(out["choices"][0]["text"])
                cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        metrics_url = f"http://127.0.0.1:{node.serving.metrics_port}/metrics"
        async with httpx.AsyncClient(timeout=30) as client:
            metrics = parse_prometheus_text((await client.get(metrics_url)).text)

        def check(core) -> None:  # type: ignore[no-untyped-def]
            core.check_conservation()
            tier = offload_tier(core.connector)  # none in the run with the tier off
            if tier is not None:
                tier.check_conservation()

        await node.thread.inspect(check)
    finally:
        assert await node.stop(grace=1.0), "seats or blocks leaked"
    return texts, cached, metrics


def test_a_colocated_node_reloads_an_evicted_conversation() -> None:
    with single_torch_thread():
        want, cached_off, _ = asyncio.run(_run(0.0))
        got, cached_on, metrics = asyncio.run(_run(0.01))
    assert got == want
    assert cached_on[-1] == 144 > cached_off[-1]  # nine full blocks of the 151-token prompt
    loaded = 144 - cached_off[-1]
    assert metrics['pdserve_kv_offload_hit_blocks_total{tier="host"}'] == loaded // 16
    assert metrics["pdserve_kv_offload_loaded_bytes_total"] > 0
    assert metrics['pdserve_kv_offload_written_bytes_total{tier="host"}'] > 0


async def _pd(cpu_gb: float) -> tuple[list[list[int]], dict[str, float], tuple[int, int]]:
    from pdserve.client import generate
    from tests.support.cluster import pd_cluster

    overrides = {"kv_offload_cpu_gb": cpu_gb}
    async with pd_cluster(
        "tiny", prefill_engine=ENGINE, decode_engine=DECODE, prefill_overrides=overrides
    ) as cluster:
        outputs = []
        for prompt in [*CONVERSATIONS, [*CONVERSATIONS[0], 7]]:
            result = await generate(cluster.targets[0], prompt, max_tokens=3, timeout=60)
            outputs.append(list(result.token_ids))
        await cluster.assert_idle_and_conserved()
        prefill_metrics = (await asyncio.to_thread(cluster.metrics))[0]
        remote = cluster.decodes[0].remote
        (peer,) = remote.pool.replicas
        # kv routing's picture of the prefill node: its pool and the tiers below it
        routing = (peer.num_offload_blocks, remote.index.capacity_of(peer.target))
    return outputs, prefill_metrics, routing


def test_a_prefill_node_reloads_an_evicted_conversation() -> None:
    """P/D: the prefill node's prefix cache gains the tier (its push connector composed with
    it); the decode node's output is the same and the prefill node counts host hits."""
    with single_torch_thread():
        want, off, (no_tier, pool_only) = asyncio.run(_pd(0.0))
        got, on, (tier, held) = asyncio.run(_pd(0.01))
    assert got == want
    assert no_tier == 0 and pool_only == ENGINE.num_kv_blocks
    assert tier > 0 and held == ENGINE.num_kv_blocks + tier
    assert "pdserve_kv_offload_loaded_bytes_total" not in off
    assert on['pdserve_kv_offload_hit_blocks_total{tier="host"}'] > 0
    assert on["pdserve_kv_offload_loaded_bytes_total"] > 0
