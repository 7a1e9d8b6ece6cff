"""`pdserve_requests_total{outcome}` (shared/serving/request_outcomes.py) on real nodes: each
request that ends moves exactly one counter by one, on the decode node by its finish reason,
`cancelled` or its status, on the prefill node by its Prefill call's `pushed`, `cancelled` or
status; n completions count once; every label is exported from the start."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator

import grpc
import httpx
import pytest

from pdserve.client import create_channel, generate, generate_stream
from proto.pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.engine.config import EngineConfig
from shared.serving.request_outcomes import DECODE_OUTCOMES, PREFILL_OUTCOMES
from tests.engine_helpers import random_prompts, single_torch_thread
from tests.support.cluster import PdCluster, pd_cluster

MODEL = "tiny"
VOCAB = 256
SHORT = random_prompts(1, VOCAB, min_len=24, max_len=24, seed=41)[0]
SLO_PROMPT = random_prompts(1, VOCAB, min_len=300, max_len=300, seed=42)[0]
# 8 prompt tokens an engine step on the prefill node: this one's prefill takes ~400 steps, long
# enough to be cancelled while it runs
LONG = random_prompts(1, VOCAB, min_len=3200, max_len=3200, seed=43)[0]
SLOW_PREFILL = EngineConfig(model=MODEL, num_kv_blocks=1024, max_batch_size=16, max_num_tokens=8)
PREFIX = 'pdserve_requests_total{outcome="'
Counts = dict[str, float]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


def _outcomes(sample: dict[str, float]) -> Counts:
    return {k[len(PREFIX) : -2]: v for k, v in sample.items() if k.startswith(PREFIX)}


async def _counts(c: PdCluster) -> list[Counts]:
    """Each node's counters: prefill nodes first, then decode nodes (PdCluster.metrics)."""
    return [_outcomes(m) for m in await asyncio.to_thread(c.metrics)]


async def _moved(
    c: PdCluster, action: Callable[[], Awaitable[object]], *want: Counts, timeout: float = 20.0
) -> None:
    """Run `action`; each node's counters must move by exactly `want` (per node, in
    PdCluster.metrics order; what is left out stays put)."""
    before = await _counts(c)
    await action()
    deadline = time.monotonic() + timeout
    while True:  # a cancelled call ends on the server a moment after the client gave up
        after = await _counts(c)
        moved = [
            {k: v - b.get(k, 0.0) for k, v in a.items() if v != b.get(k, 0.0)}
            for a, b in zip(after, before, strict=True)
        ]
        if moved == list(want) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert moved == list(want)


async def _refused(c: PdCluster, request: generation_pb2.GenerateRequest) -> grpc.StatusCode:
    channel = create_channel(c.targets[0])
    try:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(request, timeout=60):
                pass
        return err.value.code()
    finally:
        await channel.close()


async def _cancel_after_first_token(target: str) -> None:
    stream = generate_stream(target, SHORT, max_tokens=3000, ignore_eos=True, timeout=60)
    async with contextlib.aclosing(stream):
        await anext(stream)  # closing it cancels the call


async def _cancel_while_prefilling(c: PdCluster) -> None:
    call = asyncio.ensure_future(generate(c.targets[0], LONG, max_tokens=4, timeout=60))
    deadline = time.monotonic() + 30
    while not c.prefills[0].jobs:  # its Prefill call runs
        assert time.monotonic() < deadline and not call.done(), "it never reached the prefill"
        await asyncio.sleep(0.002)
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call


def test_each_request_moves_one_outcome_on_each_node() -> None:
    async def body() -> None:
        async with pd_cluster(
            MODEL, prefill_engine=SLOW_PREFILL, decode_overrides={"http_port": 0}
        ) as c:
            t = c.targets[0]
            first = await _counts(c)
            assert set(first[0]) == set(PREFILL_OUTCOMES) and set(first[1]) == set(DECODE_OUTCOMES)
            assert all(v == 0 for counts in first for v in counts.values())

            async def cut() -> None:
                done = await generate(t, SHORT, max_tokens=3, ignore_eos=True, timeout=60)
                assert done.finish_reason == "length"

            await _moved(c, cut, {"pushed": 1}, {"length": 1})
            # the first token forced to a stop token: a request that stops
            forced = {"logit_bias": {7: 100.0}, "stop_token_ids": (7,), "max_tokens": 8}

            async def stops() -> None:
                assert (await generate(t, SHORT, timeout=60, **forced)).finish_reason == "stop"

            await _moved(c, stops, {"pushed": 1}, {"stop": 1})

            async def bad_sampling() -> None:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await generate(t, SHORT, max_tokens=3, temperature=-1.0, timeout=60)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            await _moved(c, bad_sampling, {}, {"invalid_argument": 1})

            async def missed_slo() -> None:
                request = generation_pb2.GenerateRequest(
                    token_ids=generation_pb2.TokenIds(ids=SLO_PROMPT),
                    sampling=generation_pb2.SamplingParams(max_tokens=4),
                    ttft_slo_ms=1,
                )
                assert await _refused(c, request) == grpc.StatusCode.RESOURCE_EXHAUSTED

            # the prefill rate has its sample (the requests above): a 1 ms target is refused
            await _moved(c, missed_slo, {}, {"resource_exhausted": 1})
            await _moved(c, lambda: _cancel_after_first_token(t), {"pushed": 1}, {"cancelled": 1})
            await _moved(c, lambda: _cancel_while_prefilling(c), {"cancelled": 1}, {"cancelled": 1})

            async def two_choices() -> None:
                url = f"http://127.0.0.1:{c.decodes[0].http_port}"
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    body = {
                        "model": MODEL,
                        "prompt": SHORT,
                        "max_tokens": 3,
                        "n": 2,
                        "ignore_eos": True,
                    }
                    resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                assert [ch["finish_reason"] for ch in resp.json()["choices"]] == ["length"] * 2

            await _moved(c, two_choices, {"pushed": 1}, {"length": 1})
            await c.assert_idle_and_conserved()
            # nothing counted late, twice: 7 requests on the decode node, 5 Prefill calls
            last = await _counts(c)
            assert sum(last[0].values()) == 5 and sum(last[1].values()) == 7

    asyncio.run(body())


def test_colocated_node_counts_its_own_requests() -> None:
    """No prefill node: the outcomes are the one node's."""

    async def body() -> None:
        async with pd_cluster(MODEL, colocated=True) as c:
            t = c.targets[0]

            async def cut() -> None:
                done = await generate(t, SHORT, max_tokens=2, ignore_eos=True, timeout=60)
                assert done.finish_reason == "length"

            await _moved(c, cut, {"length": 1})

            async def duplicate() -> None:
                stream = generate_stream(
                    t, SHORT, max_tokens=3000, ignore_eos=True, request_id="twice", timeout=60
                )
                async with contextlib.aclosing(stream):
                    await anext(stream)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await generate(t, SHORT, max_tokens=2, request_id="twice", timeout=60)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            await _moved(c, duplicate, {"invalid_argument": 1, "cancelled": 1})
            await c.assert_idle_and_conserved()

    asyncio.run(body())
