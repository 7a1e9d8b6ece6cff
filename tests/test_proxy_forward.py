"""`pdserve proxy` over gRPC: answers and errors pass through unchanged, and an UNAVAILABLE
from a backend that has not answered yet is retried on another decode replica."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.client import generate
from pdserve.proxy import Proxy
from tests.engine_helpers import single_torch_thread
from tests.support.cluster import pd_cluster

MODEL = "tiny"


def test_grpc_errors_pass_through_and_unavailable_is_retried() -> None:
    async def main() -> None:
        async with pd_cluster(MODEL, num_decode=2) as cluster:
            a, b = cluster.decodes
            proxy = Proxy([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], health_interval=0.2)
            await proxy.start("127.0.0.1", 0)
            try:
                while not all(r.healthy for r in proxy.pool.replicas):
                    await asyncio.sleep(0.05)
                via = f"127.0.0.1:{proxy.port}"
                want = await generate(cluster.targets[0], [5, 6, 7], max_tokens=4, timeout=30)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await generate(via, [5, 6, 7], max_tokens=4, temperature=-1.0, timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "temperature" in err.value.details()
                b.accepting = False  # answers UNAVAILABLE ("shutting down") before any token
                for _ in range(6):  # the pool rotates over equal loads: some try b first
                    got = await generate(via, [5, 6, 7], max_tokens=4, timeout=30)
                    assert got.token_ids == want.token_ids
                b.accepting = True
                retries = proxy.registry.get_sample_value("pdserve_proxy_retries_total")
                assert retries is not None and retries >= 1
                await cluster.assert_idle_and_conserved()
                assert all(r.load == 0 for r in proxy.pool.replicas)
            finally:
                await proxy.stop(1.0)

    with single_torch_thread():
        asyncio.run(main())
