"""`pdserve proxy` forwards the HTTP API: answers and errors pass through unchanged, SSE streams
unbuffered, and a client that disconnects (before the first token or mid-stream) cancels the
request on the decode node and the prefill node behind it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx

from pdserve.proxy import Proxy
from tests.support.cluster import PdCluster, pd_cluster

MODEL = "tiny"


def _completion(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": "Hello there", "temperature": 0.0, **fields}


async def _no_streams(cluster: PdCluster) -> None:
    deadline = time.monotonic() + 30
    while cluster.decodes[0].streams:
        assert time.monotonic() < deadline, "the decode node still runs the request"
        await asyncio.sleep(0.01)


def test_http_through_the_proxy() -> None:
    async def main() -> None:
        async with pd_cluster(MODEL, decode_overrides={"http_port": 0}) as cluster:
            decode = cluster.decodes[0]
            proxy = Proxy([f"127.0.0.1:{decode.port}"], health_interval=0.5)
            await proxy.start("127.0.0.1", 0, http_port=0, backend_http_port=decode.http_port)
            try:
                assert proxy.http_server is not None
                url = f"http://127.0.0.1:{proxy.http_server.port}"
                direct = f"http://127.0.0.1:{decode.http_port}"
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    await _exercise(cluster, client, direct)
                await cluster.assert_idle_and_conserved()
                assert all(b.load == 0 for b in proxy.pool.replicas)
            finally:
                await proxy.stop(1.0)

    asyncio.run(main())


async def _exercise(cluster: PdCluster, client: httpx.AsyncClient, direct: str) -> None:
    assert (await client.get("/health")).status_code == 200
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == MODEL
    via = await client.post("/v1/completions", json=_completion(max_tokens=6))
    async with httpx.AsyncClient(base_url=direct, timeout=60) as d:
        want = await d.post("/v1/completions", json=_completion(max_tokens=6))
    assert via.status_code == 200 and via.json()["choices"] == want.json()["choices"]
    missing = await client.post("/v1/completions", json=_completion(model="nope"))
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    bad = await client.post("/v1/completions", content=b"{", headers={"content-type": "x"})
    assert bad.status_code == 400

    # unbuffered: the first event arrives while the decode node is still generating; leaving
    # the stream early cancels the request upstream
    long = _completion(max_tokens=3000, ignore_eos=True, stream=True)
    async with client.stream("POST", "/v1/completions", json=long) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.aiter_lines()
        first = await anext(lines)
        assert json.loads(first.removeprefix("data: "))["object"] == "text_completion"
        assert cluster.decodes[0].streams, "the stream was buffered to its end"
    await _no_streams(cluster)

    # a client that gives up before the first token (the prefill node is busy)
    busy = asyncio.ensure_future(cluster.prefills[0].thread.inspect(lambda core: time.sleep(1.5)))
    await asyncio.sleep(0.05)
    try:
        await client.post("/v1/completions", json=_completion(stream=True), timeout=0.4)
        raise AssertionError("the request should have timed out on the client")
    except httpx.ReadTimeout:
        pass
    await _no_streams(cluster)
    await busy
    done = await client.post("/v1/completions", json=_completion(max_tokens=3, stream=True))
    assert done.text.endswith("data: [DONE]\n\n")


def test_http_requests_spread_over_decode_replicas() -> None:
    """Two decode replicas on one HTTP port (127.0.0.1 and 127.0.0.2, as replicas behind one
    service name): concurrent streams go to both, least loaded first."""
    from dataclasses import replace

    from decode_node.server import DecodeNode
    from shared.model.loader import load_model

    async def main() -> None:
        async with pd_cluster(MODEL, decode_overrides={"http_port": 0}) as cluster:
            first = cluster.decodes[0]
            config = replace(first.config, host="127.0.0.2", http_port=first.http_port)
            second = DecodeNode(config, load_model(MODEL))
            await second.start()
            backends = [f"127.0.0.1:{first.port}", f"127.0.0.2:{second.port}"]
            proxy = Proxy(backends, health_interval=0.5)
            await proxy.start("127.0.0.1", 0, http_port=0, backend_http_port=first.http_port)
            try:
                assert proxy.http_server is not None
                url = f"http://127.0.0.1:{proxy.http_server.port}"
                limits = httpx.Limits(max_connections=16)
                async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
                    await _hold_streams(client, [first, second])
                await cluster.assert_idle_and_conserved()
                await second.thread.inspect(lambda core: core.check_conservation())
            finally:
                await proxy.stop(1.0)
                conserved = await second.stop(grace=1.0)
            assert conserved, "the second replica did not get all seats and blocks back"

    asyncio.run(main())


async def _hold_streams(client: httpx.AsyncClient, decodes: list) -> None:
    long = _completion(max_tokens=3000, ignore_eos=True, stream=True)
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(6):
            resp = await stack.enter_async_context(
                client.stream("POST", "/v1/completions", json=long)
            )
            assert resp.status_code == 200  # headers follow the first token: admitted
        counts = sorted(len(d.streams) for d in decodes)
        assert counts == [3, 3], f"streams per replica: {counts}"
    for decode in decodes:  # leaving the streams cancels them on both replicas
        deadline = time.monotonic() + 30
        while decode.streams:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
