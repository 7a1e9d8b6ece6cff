"""`pdserve proxy --routing kv` over two real decode replicas: prompts that share a prefix land
on the replica whose prefix cache holds it (seen in the replicas' own prefix-cache counters),
unrelated prompts spread, and `--routing least-loaded` does not stick. gRPC and HTTP."""

from __future__ import annotations

import asyncio
import random
import urllib.request
from dataclasses import replace

import httpx

from pdserve.client import generate
from pdserve.proxy import Proxy
from shared.serving.metrics import parse_prometheus_text
from tests.engine_helpers import single_torch_thread
from tests.support.cluster import PdCluster, pd_cluster

MODEL = "tiny"  # byte-level: a text prompt of N ASCII bytes is N tokens (plus BOS)
# the decode replicas prefill these prompts themselves: their own prefix caches are what the
# routing aims at, and their pdserve_prompt_tokens_total{source="cached"} shows each hit
LOCAL = {"local_prefill_tokens": 4096}
BS = 16  # the engine's block size
CACHED = 'pdserve_prompt_tokens_total{source="cached"}'


async def start_proxy(backends: list[str], routing: str, backend_http: int = 0) -> Proxy:
    """The proxy, its HTTP side on when `backend_http` (the replicas' HTTP port) is given."""
    proxy = Proxy(backends, health_interval=0.2, routing=routing)
    http_port = 0 if backend_http else -1
    await proxy.start("127.0.0.1", 0, http_port=http_port, backend_http_port=backend_http)
    while not all(r.healthy and r.connected for r in proxy.pool.replicas):
        await asyncio.sleep(0.05)
    return proxy


def served_by(cluster: PdCluster, request_id: str) -> int:
    (index,) = [
        i for i, d in enumerate(cluster.decodes) if request_id in dict(d.core.recent_history)
    ]
    return index


async def cached_tokens(decodes: list[tuple[str, object]]) -> list[float]:
    """Each (host, decode node)'s prompt tokens reused from its own prefix cache."""

    def scrape() -> list[float]:
        out = []
        for host, node in decodes:
            url = f"http://{host}:{node.serving.metrics_port}/metrics"  # type: ignore[attr-defined]
            with urllib.request.urlopen(url, timeout=5) as resp:
                out.append(parse_prometheus_text(resp.read().decode())[CACHED])
        return out

    return await asyncio.to_thread(scrape)


def routed(proxy: Proxy, backend: str, reason: str) -> float:
    labels = {"backend": backend, "reason": reason}
    return proxy.registry.get_sample_value("pdserve_proxy_routed_total", labels) or 0.0


def test_grpc_prompts_sharing_a_prefix_follow_it() -> None:
    rng = random.Random(14)
    base = [rng.randrange(256) for _ in range(200)]
    tails = [[rng.randrange(256) for _ in range(24)] for _ in range(4)]
    unrelated = [[rng.randrange(256) for _ in range(120)] for _ in range(4)]

    async def main() -> None:
        async with pd_cluster(MODEL, num_decode=2, decode_overrides=LOCAL) as cluster:
            backends = cluster.targets
            proxy = await start_proxy(backends, "kv")
            try:
                via = f"127.0.0.1:{proxy.port}"
                first = await generate(via, base, max_tokens=2, timeout=30)
                holder = served_by(cluster, first.request_id)
                for tail in tails:
                    got = await generate(via, [*base, *tail], max_tokens=2, timeout=30)
                    assert served_by(cluster, got.request_id) == holder
                cached = await cached_tokens([("127.0.0.1", d) for d in cluster.decodes])
                # each follow-up found the base's full blocks in the holder's own cache
                assert cached[holder] == len(tails) * (len(base) // BS) * BS
                assert cached[1 - holder] == 0
                assert routed(proxy, backends[holder], "prefix") == len(tails)
                spread = set()
                for prompt in unrelated:  # nothing cached anywhere: they rotate over both
                    got = await generate(via, prompt, max_tokens=2, timeout=30)
                    spread.add(served_by(cluster, got.request_id))
                assert spread == {0, 1}
                assert all(r.load == 0 for r in proxy.pool.replicas)
                assert not proxy.router.outstanding
            finally:
                await proxy.stop(1.0)
            proxy = await start_proxy(backends, "least-loaded")
            try:  # the same kind of traffic, least-loaded: the shared prefix does not stick
                via = f"127.0.0.1:{proxy.port}"
                other = [rng.randrange(256) for _ in range(200)]
                where = set()
                for tail in [[], *tails]:
                    got = await generate(via, [*other, *tail], max_tokens=2, timeout=30)
                    where.add(served_by(cluster, got.request_id))
                assert where == {0, 1}
                assert len(proxy.router.index) == 0
            finally:
                await proxy.stop(1.0)
            await cluster.assert_idle_and_conserved()

    with single_torch_thread():
        asyncio.run(main())


def test_http_completions_sharing_a_prefix_follow_it() -> None:
    """Two decode replicas on one HTTP port (127.0.0.1 and 127.0.0.2, as replicas behind one
    service name) behind the proxy's HTTP side."""
    from decode_node.server import DecodeNode
    from shared.model.loader import load_model

    rng = random.Random(15)
    system = "".join(rng.choice("abcdefghij ") for _ in range(300))

    async def main() -> None:
        overrides = {**LOCAL, "http_port": 0}
        async with pd_cluster(MODEL, decode_overrides=overrides) as cluster:
            first = cluster.decodes[0]
            config = replace(first.config, host="127.0.0.2", http_port=first.http_port)
            second = DecodeNode(config, load_model(MODEL))
            await second.start()
            decodes = [("127.0.0.1", first), ("127.0.0.2", second)]
            backends = [f"127.0.0.1:{first.port}", f"127.0.0.2:{second.port}"]
            proxy = await start_proxy(backends, "kv", backend_http=first.http_port)
            try:
                assert proxy.http_server is not None
                url = f"http://127.0.0.1:{proxy.http_server.port}"
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    await _exercise_http(client, proxy, decodes, backends, system)
                await cluster.assert_idle_and_conserved()
                await second.thread.inspect(lambda core: core.check_conservation())
                assert all(r.load == 0 for r in proxy.pool.replicas)
                assert not proxy.router.outstanding
            finally:
                await proxy.stop(1.0)
                conserved = await second.stop(grace=1.0)
            assert conserved, "the second replica did not get all seats and blocks back"

    with single_torch_thread():
        asyncio.run(main())


async def _exercise_http(
    client: httpx.AsyncClient,
    proxy: Proxy,
    decodes: list[tuple[str, object]],
    backends: list[str],
    system: str,
) -> None:
    def completion(prompt: str) -> dict[str, object]:
        return {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}

    resp = await client.post("/v1/completions", json=completion(system))
    assert resp.status_code == 200, resp.text
    assert await cached_tokens(decodes) == [0, 0]  # nothing reused yet on either
    questions = [f"{i}: why?" for i in range(3)]  # they part right after the system text
    for q in questions:
        resp = await client.post("/v1/completions", json=completion(system + q))
        assert resp.status_code == 200, resp.text
    cached = await cached_tokens(decodes)
    hit = [i for i, c in enumerate(cached) if c > 0]
    assert len(hit) == 1, f"the shared prefix was served on {cached}"
    # BOS + the system text: its full blocks, found again by each question
    assert cached[hit[0]] == len(questions) * ((1 + len(system)) // BS) * BS
    assert routed(proxy, backends[hit[0]], "prefix") == len(questions)
    # a malformed body is still forwarded (the replica answers it), routed by load
    load_before = sum(routed(proxy, b, "load") for b in backends)
    bad = await client.post("/v1/completions", content=b"{", headers={"content-type": "x"})
    assert bad.status_code == 400
    assert sum(routed(proxy, b, "load") for b in backends) == load_before + 1
