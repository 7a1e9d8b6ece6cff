"""`pdserve colocated`: a decode node with no prefill nodes, every prompt prefilled by its own
engine, behind the same public gRPC and HTTP contract, limits, deadlines and drain as a decode
node. In-process (real gRPC, uvicorn, torch); after every scenario every seat and block is back
in its pool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from decode_node.config import DecodeNodeConfig
from pdserve.cli.main import build_parser
from pdserve.client import generate, generate_stream, get_model_info
from proto.pdserve.v1 import generation_pb2
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.requests.request import LlmRequestState
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.engine_helpers import random_prompts, single_torch_thread
from tests.sampling_reference import pd_generate

MODEL = "tiny"
ENGINE = EngineConfig(model=MODEL, num_kv_blocks=256, max_batch_size=8)
S = LlmRequestState


@pytest.fixture(autouse=True)
def _one_thread():
    with single_torch_thread():
        yield


@contextlib.asynccontextmanager
async def colocated(**overrides: object) -> AsyncIterator[object]:
    from decode_node.server import DecodeNode

    cfg = DecodeNodeConfig(
        engine=ENGINE, colocated=True, port=0, metrics_port=0, http_port=0, **overrides
    )
    node = DecodeNode(cfg, load_model(MODEL))
    await node.start()
    try:
        yield node
    finally:
        assert await node.stop(grace=1.0), "seats or blocks leaked"


async def _conserved(node) -> None:
    for _ in range(200):
        if not node.streams and not node.core.requests:
            break
        await asyncio.sleep(0.05)
    await node.thread.inspect(lambda core: core.check_conservation())


def test_config_and_cli() -> None:
    with pytest.raises(ValueError, match="prefill targets"):
        DecodeNodeConfig(colocated=True, prefill_targets=("h:1",)).validate()
    DecodeNodeConfig(colocated=True).validate()
    a = build_parser().parse_args(["colocated", "--model", MODEL, "--max-inflight", "3"])
    assert a.command == "colocated" and a.max_inflight == 3 and a.prefill == ""


def test_colocated_matches_the_offline_engine() -> None:
    prompts = random_prompts(6, 259, min_len=3, max_len=700, seed=81)
    params = [
        SamplingParams(max_tokens=8),
        SamplingParams(max_tokens=8, temperature=0.8, seed=5),
        SamplingParams(max_tokens=5, temperature=1.0, seed=9, n=2, logprobs=1),
    ] * 2
    reference = LLM(ENGINE)
    pairs = list(zip(prompts, params, strict=True))
    want = [[o.token_ids for o in reference.generate([p], q)] for p, q in pairs]

    async def body() -> None:
        async with colocated() as node:
            target = f"127.0.0.1:{node.port}"
            info = await get_model_info(target)
            assert info.node_role == generation_pb2.NODE_ROLE_COLOCATED
            got = await asyncio.gather(
                *(pd_generate(target, p, q) for p, q in zip(prompts, params, strict=True))
            )
            assert [[c.token_ids for c in g] for g in got] == want
            histories = [[s for s, _ in h] for _, h in node.core.recent_history]
            assert all(S.DISAGG_GENERATION_INIT not in h for h in histories)
            await _conserved(node)

    asyncio.run(body())


def test_http_health_limits_deadline_and_cancel() -> None:
    prompt = random_prompts(1, 259, min_len=50, max_len=50, seed=83)[0]

    async def body() -> None:
        async with colocated(max_inflight=1, max_queued=0) as node:
            target = f"127.0.0.1:{node.port}"
            url = f"http://127.0.0.1:{node.http_port}"
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                assert (await client.get("/health")).status_code == 200
                body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["completion_tokens"] >= 1
            # one request live: the next is refused with a retry hint (limits as a decode node)
            long = generate_stream(target, prompt, max_tokens=400, ignore_eos=True, timeout=60)
            async with contextlib.aclosing(long) as stream:
                await anext(stream)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await generate(target, prompt, max_tokens=2, timeout=30)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # cancelled mid-stream (the aclosing above), then a deadline while decoding
            await _conserved(node)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(target, prompt, max_tokens=3000, ignore_eos=True, timeout=0.3)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await _conserved(node)
            ok = await generate(target, prompt, max_tokens=3, timeout=30)
            assert len(ok.token_ids) == 3
            await _conserved(node)

    asyncio.run(body())
