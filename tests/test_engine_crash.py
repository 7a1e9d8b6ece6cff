"""A decode engine thread that dies (a bug: here an exception injected into its forward) must
not leave anyone waiting: the request in its batch is answered UNAVAILABLE at once, health
turns NOT_SERVING on gRPC and HTTP (an orchestrator restarts the node, a router sends
elsewhere), later requests are refused UNAVAILABLE, and the node still stops cleanly."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client import generate, generate_stream
from shared.engine.core import EngineCore
from shared.engine.sampling.sampling_params import SamplingParams
from tests.support.cluster import pd_cluster


def _break_forward(core: EngineCore) -> None:
    def forward(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected engine fault")

    core.runner.forward = forward  # type: ignore[method-assign]


def test_a_crashed_engine_answers_its_requests_and_reports_down() -> None:
    async def body() -> None:
        async with pd_cluster("tiny", colocated=True, decode_overrides={"http_port": 0}) as c:
            node, target = c.decodes[0], c.targets[0]
            params = SamplingParams(max_tokens=4)
            assert (await generate(target, "before", params)).text
            await node.thread.inspect(_break_forward)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async with contextlib.aclosing(generate_stream(target, "x", params)) as stream:
                    async for _ in stream:
                        pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
            assert "injected engine fault" in str(e.value.details())
            async with grpc.aio.insecure_channel(target) as channel:
                check = health_pb2_grpc.HealthStub(channel).Check
                status = (await check(health_pb2.HealthCheckRequest(service=""))).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            async with httpx.AsyncClient(timeout=10) as client:
                health = await client.get(f"http://127.0.0.1:{node.http_port}/health")
            assert health.status_code == 503 and "engine stopped" in health.text, health.text
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(target, "after", params)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
            assert not await node.stop(grace=0.5)  # stops, reporting what it could not free

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_crashed_prefill_engine_ends_its_prefills_at_once() -> None:
    """The prefill node's engine dies under a request: its Prefill call is answered UNAVAILABLE
    at once (not at the push's deadline), the decode node answers its client UNAVAILABLE naming
    the cause and gets every block back, and the next request is refused at once too."""

    async def body() -> None:
        async with pd_cluster("tiny") as c:
            prefill, decode, target = c.prefills[0], c.decodes[0], c.targets[0]
            params = SamplingParams(max_tokens=4)
            assert (await generate(target, "before", params)).text
            await prefill.thread.inspect(_break_forward)
            # the first: its Prefill call fails; the next: the node is marked unhealthy now
            for why in ("engine stopped", "every prefill node is marked unhealthy"):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await asyncio.wait_for(generate(target, "x" * 40, params, timeout=120), 20)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
                assert why in str(e.value.details()), e.value
            await decode.thread.inspect(lambda core: core.check_conservation())
            assert not await prefill.stop(grace=0.5)

    asyncio.run(asyncio.wait_for(body(), 90))
