"""The context a node advertises is the one its KV pool serves: `--kv-cache-mb 1` alone starts
and advertises what fits (/v1/models, /tokenizer_info, GetModelInfo, /version), with
`--max-model-len 4096` (the tiny model's whole context) it refuses to start naming both flags
(through `pdserve up`, so the flags reach the nodes it starts), and a decode node advertises and
admits no more than its prefill node's pool holds, refusing at once a prompt that pool cannot
take. Real nodes, gRPC, HTTP; the built-in tiny model (the sizing reads only KV bytes per token,
so a small pool of a small model takes the same paths as SmolLM2's)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import httpx
import pytest

from pdserve.client import get_model_info
from shared.engine.config import EngineConfig
from shared.engine.sampling.sampling_params import SamplingParams
from tests.engine_helpers import random_prompts, single_torch_thread
from tests.sampling_reference import pd_generate
from tests.support.cluster import pd_cluster

TINY = "tiny"
TINY_FP32_BLOCK = 4 * 2 * 16 * 2 * 32 * 4  # layers x K,V x tokens x heads x dim x bytes
MB1_TOKENS = (1 << 20) // TINY_FP32_BLOCK * 16  # 32 blocks
MB1_CONTEXT = MB1_TOKENS + 1  # a request's last token is sampled, never stored


@pytest.fixture(autouse=True)
def _one_thread():
    with single_torch_thread():
        yield


async def _advertised(node, http: httpx.AsyncClient) -> dict[str, int]:
    """The context each surface reports."""
    models = (await http.get("/v1/models")).json()["data"][0]
    version = (await http.get("/version")).json()["kv_pool"]
    info = await get_model_info(f"127.0.0.1:{node.port}")
    return {
        "models": models["max_model_len"],
        "tokenizer_info": (await http.get("/tokenizer_info")).json()["model_max_length"],
        "grpc": info.max_context,
        "version": version["max_model_len"],
    }


def test_kv_cache_mb_1_alone_serves_what_fits() -> None:
    engine = EngineConfig(model=TINY, dtype="float32", kv_cache_memory_mb=1)

    async def body() -> None:
        async with pd_cluster(
            TINY, colocated=True, decode_engine=engine, decode_overrides={"http_port": 0}
        ) as c:
            node = c.decodes[0]
            url = f"http://127.0.0.1:{node.http_port}"
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                seen = await _advertised(node, http)
                assert MB1_TOKENS == 512 and set(seen.values()) == {MB1_CONTEXT}, seen
                pool = (await http.get("/version")).json()["kv_pool"]
                assert pool["num_blocks"] == 32 and pool["tokens"] == 512, pool
                assert pool["sized_by"] == "--kv-cache-mb 1", pool
                # the advertised context is served: a prompt filling it but max_tokens
                prompt = random_prompts(1, 256, min_len=505, max_len=505, seed=3)[0]
                got = await pd_generate(
                    c.targets[0], prompt, SamplingParams(max_tokens=8, ignore_eos=True)
                )
                assert len(got[0].token_ids) == 8, got
                # and one token more is refused before anything is allocated, naming the limit
                body = {"model": TINY, "prompt": [*prompt, 7], "max_tokens": 8}
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 400, r.text
                assert "exceeds the model's context of 513 tokens" in r.json()["error"]["message"]

    asyncio.run(body())


def test_max_model_len_the_pool_cannot_hold_refuses_to_start() -> None:
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", TINY]
    argv += ["--dtype", "float32", "--kv-cache-mb", "1", "--max-model-len", "4096"]
    argv += ["--port", "0", "--http-port", "0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    line = next(x for x in done.stderr.splitlines() if "invalid configuration" in x)
    assert "--max-model-len 4096 needs 256 KV blocks" in line, line
    assert "raise --kv-cache-mb to at least 8" in line, line
    assert "lower --max-model-len to at most 513" in line, line


def test_decode_node_serves_no_more_than_the_prefill_pool_holds() -> None:
    """Prefill pool 8 blocks (128 tokens), decode pool 64 (1,024): the decode node advertises
    129 everywhere (a pool of prompt and the first token, never stored), serves a request that
    fills it, and refuses one token more at once with the prefill node's limit, over gRPC and
    HTTP."""
    prefill = EngineConfig(model=TINY, num_kv_blocks=8, max_batch_size=4)
    decode = EngineConfig(model=TINY, num_kv_blocks=64, max_batch_size=4)

    async def body() -> None:
        async with pd_cluster(
            TINY, prefill_engine=prefill, decode_engine=decode, decode_overrides={"http_port": 0}
        ) as c:
            node, target = c.decodes[0], c.targets[0]
            assert node.engine_info.max_model_len == 1025  # its own pool: the prefill's limits
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{node.http_port}") as http:
                seen = await _advertised(node, http)
                assert set(seen.values()) == {129}, seen
                prompt = random_prompts(1, 259, min_len=121, max_len=121, seed=5)[0]
                got = await pd_generate(
                    target, prompt, SamplingParams(max_tokens=8, ignore_eos=True)
                )
                assert len(got[0].token_ids) == 8 and got[0].finish_reason == "FINISH_REASON_LENGTH"
                prefill_target = f"127.0.0.1:{c.prefills[0].port}"
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await pd_generate(target, [*prompt, 3], SamplingParams(max_tokens=8))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                message = e.value.details() or ""
                assert "exceeds the prefill nodes' context of 129 tokens" in message, message
                assert f"prefill node {prefill_target}: 8 KV blocks = 128 tokens" in message
                body = {"model": TINY, "prompt": [*prompt, 3], "max_tokens": 8}
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 400 and "prefill nodes' context" in r.text, r.text
            assert not node.streams

    asyncio.run(body())
