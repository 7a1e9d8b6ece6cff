"""/health on a decode node says whether it can serve every request now, and why: 200 while a
prefill node is healthy or, with none healthy, while the local-prefill fallback can prefill
every prompt here (the requests are then served, which the test shows); 503 when no prefill node
is healthy and the fallback is off (the requests are then refused), or while shutting down."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx

from tests.support.cluster import pd_cluster

COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}


def test_health_agrees_with_what_the_node_can_serve() -> None:
    async def main() -> None:
        # no health round during the test: the prefill node stays as the test marks it
        overrides = {"http_port": 0, "local_prefill_fallback": True, "health_check_interval": 600}
        async with pd_cluster("tiny", decode_overrides=overrides) as cluster:
            node = cluster.decodes[0]
            url = f"http://127.0.0.1:{node.http_port}"
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                health = await client.get("/health")
                assert (health.status_code, health.text) == (
                    200,
                    "ok: 1 of 1 prefill nodes healthy\n",
                )

                for peer in node.pool.replicas:
                    node.pool.mark_unhealthy(peer, "test: as after failed health checks")
                health = await client.get("/health")
                assert health.status_code == 200, health.text
                assert "no prefill node is healthy" in health.text
                assert "prefilled here" in health.text
                served = await client.post("/v1/completions", json=COMPLETION)
                assert served.status_code == 200, served.text  # what 200 promised

                node.config = replace(node.config, local_prefill_fallback=False)
                health = await client.get("/health")
                assert health.status_code == 503 and health.headers["retry-after"] == "1"
                assert health.text.startswith("not serving: no prefill node is healthy")
                assert "--no-local-prefill-fallback" in health.text
                refused = await client.post("/v1/completions", json=COMPLETION)
                assert refused.status_code == 503, refused.text  # what 503 warned of

                node.accepting = False
                health = await client.get("/healthz")
                assert (health.status_code, health.text) == (503, "not serving: shutting down\n")
                node.accepting = True
            await cluster.assert_idle_and_conserved()

    asyncio.run(main())
