"""Health checks of a replica pool against a real gRPC health service: a replica that misses one
answer (busy) keeps taking work, one that misses two rounds running or answers NOT_SERVING is
dropped from routing at once, and one that answers again comes back."""

from __future__ import annotations

import asyncio

from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.serving.replica_pool import Replica, ReplicaPool


class SlowHealth(health.HealthServicer):
    """The standard health service, answering `delay` seconds late."""

    def __init__(self) -> None:
        super().__init__(experimental_non_blocking=True)
        self.delay = 0.0

    async def Check(self, request, context):
        await asyncio.sleep(self.delay)
        return super().Check(request, context)


def test_one_slow_answer_keeps_a_replica_two_drop_it_and_not_serving_drops_it_at_once() -> None:
    async def body() -> None:
        server = aio.server()
        servicer = SlowHealth()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        target = f"127.0.0.1:{port}"

        def connect(address: str, host: str) -> Replica:
            return Replica(address, host, aio.insecure_channel(address))

        # interval 0.4 s: each check waits at most 0.2 s; rounds run here, not on a timer
        pool: ReplicaPool[Replica] = ReplicaPool("test", [target], 0.4, connect)
        await pool.refresh()
        try:
            [replica] = pool.replicas
            await pool.refresh()
            assert replica.healthy
            servicer.delay = 0.5
            await pool.refresh()
            assert replica.healthy and replica.slow_checks == 1  # one late answer: still routed
            await pool.refresh()
            assert not replica.healthy and pool.pick(set()) is None  # two rounds running
            servicer.delay = 0.0
            await pool.refresh()
            assert replica.healthy and replica.slow_checks == 0
            servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # draining
            await pool.refresh()
            assert not replica.healthy
        finally:
            await pool.close()
            await server.stop(0)

    asyncio.run(body())
