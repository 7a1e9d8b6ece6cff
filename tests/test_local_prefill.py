"""Conditional (local) prefill on the decode node and its fallback: real gRPC, UCX and torch.

The same prompts and sampling run through the decode node's own engine (local prefill) and
through a prefill node (remote) must give the same tokens and logprobs: greedy, seeded, n > 1,
penalties and prompt logprobs alike (the seeded stream is per request and output index)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from pdserve.client import generate
from shared.engine.requests.request import LlmRequest, LlmRequestState
from shared.engine.resources.block_manager import compute_block_hashes
from shared.engine.sampling.sampling_params import SamplingParams
from tests.engine_helpers import hf_greedy, random_prompts, single_torch_thread
from tests.sampling_reference import pd_generate, same_logprobs
from tests.support.cluster import PdCluster, pd_cluster

S = LlmRequestState

PARAMS = [
    SamplingParams(max_tokens=8),
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=7),
    SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, logprobs=2),
    SamplingParams(max_tokens=6, repetition_penalty=1.3, presence_penalty=0.5, logprobs=1),
    SamplingParams(max_tokens=4, prompt_logprobs=2, temperature=0.7, seed=3),
]


@pytest.fixture(autouse=True)
def _one_thread():
    with single_torch_thread():
        yield


async def _set(c: PdCluster, **fields: object) -> None:
    """Switch the decode node's placement between requests: the fallback is the node's (read
    per request), the local-prefill bounds its engine's (shared/engine/scheduling/placement.py)."""
    node = c.decodes[0]
    node.config = replace(node.config, **fields)
    policy = node.config.decode_settings(node.slo).placement

    def place(core) -> None:
        core.role.placement.policy = policy

    await node.thread.inspect(place)


async def _decode_metrics(c: PdCluster) -> dict[str, float]:
    return (await asyncio.to_thread(c.metrics))[-1]  # the decode node's is last


async def _prefills(c: PdCluster) -> dict[str, float]:
    m = await _decode_metrics(c)
    return {w: m.get(f'pdserve_prefills_total{{where="{w}"}}', 0.0) for w in ("local", "remote")}


async def _decode_conserved(c: PdCluster) -> None:
    node = c.decodes[0]
    for _ in range(200):
        if not node.streams and not node.core.requests:
            break
        await asyncio.sleep(0.05)
    await node.thread.inspect(lambda core: core.check_conservation())


def test_local_and_remote_prefill_are_token_exact(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    prompts = random_prompts(len(PARAMS), 512, min_len=5, max_len=90, seed=41)

    async def run_all(target: str) -> list[list]:
        return [await pd_generate(target, p, q) for p, q in zip(prompts, PARAMS, strict=True)]

    async def body() -> None:
        overrides = {"local_prefill_tokens": 256}
        async with pd_cluster(path, decode_overrides=overrides) as c:
            local = await run_all(c.targets[0])
            assert await _prefills(c) == {"local": len(PARAMS), "remote": 0}
            await _set(c, local_prefill_tokens=0)
            remote = await run_all(c.targets[0])
            assert await _prefills(c) == {"local": len(PARAMS), "remote": len(PARAMS)}
            for a_all, b_all, q in zip(local, remote, PARAMS, strict=True):
                assert len(a_all) == len(b_all) == q.n
                for a, b in zip(a_all, b_all, strict=True):
                    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
                    assert same_logprobs(a.logprobs, b.logprobs, tol=1e-4)
                    if q.prompt_logprobs is not None:
                        assert a.prompt_logprobs is not None
                        assert same_logprobs(
                            [x for x in a.prompt_logprobs if x],
                            [x for x in b.prompt_logprobs if x],
                            tol=1e-4,
                        )
            assert local[0][0].token_ids == hf_greedy(path, prompts[0], 8)
            histories = dict(c.decodes[0].core.recent_history)
            local_states = [s for s, _ in next(iter(histories.values()))]
            assert S.CONTEXT_INIT in local_states and S.DISAGG_GENERATION_INIT not in local_states
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def test_threshold_and_prefix_hit_decide_placement(checkpoint: Callable[..., Path]) -> None:
    """Long prompts go remote; the same prompt again, now in this node's prefix cache, leaves
    few uncached tokens and is prefilled here."""
    path = checkpoint("llama")
    prompt = random_prompts(1, 512, min_len=200, max_len=200, seed=43)[0]
    block = 32

    async def body() -> None:
        # the one-step rule alone: an idle engine would take the 200-token prompt too
        overrides = {"local_prefill_tokens": block + 1, "local_prefill_idle_tokens": 0}
        async with pd_cluster(path, decode_overrides=overrides) as c:
            first = await generate(c.targets[0], prompt, max_tokens=4, timeout=60)
            assert await _prefills(c) == {"local": 0, "remote": 1}
            again = await generate(c.targets[0], prompt, max_tokens=4, timeout=60)
            assert await _prefills(c) == {"local": 1, "remote": 1}
            assert again.token_ids == first.token_ids == hf_greedy(path, prompt, 4)
            assert again.usage.cached_tokens >= len(prompt) - block
            m = await _decode_metrics(c)
            assert m['pdserve_prompt_tokens_total{source="cached"}'] == again.usage.cached_tokens
            computed = m['pdserve_prompt_tokens_total{source="computed"}']
            assert computed == len(prompt) - again.usage.cached_tokens
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def test_fallback_serves_without_prefill_nodes(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    prompts = random_prompts(3, 512, min_len=300, max_len=400, seed=45)

    async def body() -> None:
        overrides = {"local_prefill_tokens": 0, "local_prefill_fallback": True}
        async with pd_cluster(path, decode_overrides=overrides) as c:
            decode = c.decodes[0]
            for peer in decode.pool.replicas:  # as after failed health checks
                decode.pool.mark_unhealthy(peer, "test: no prefill node")
            got = await generate(c.targets[0], prompts[0], max_tokens=5, timeout=60)
            assert got.token_ids == hf_greedy(path, prompts[0], 5)
            assert (await _prefills(c))["local"] == 1
            await _set(c, local_prefill_fallback=False)
            for peer in decode.pool.replicas:
                decode.pool.mark_unhealthy(peer, "test: no prefill node")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(c.targets[0], prompts[1], max_tokens=5, timeout=60)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "prefill" in err.value.details()
            await _decode_conserved(c)
            # a prefill node that dies under the decode node: the dispatch fails, and the
            # request already admitted for a transfer is prefilled here instead
            await _set(c, local_prefill_fallback=True)
            await c.prefills[0].serving.stop_admitting(0.1)
            got = await generate(c.targets[0], prompts[2], max_tokens=5, timeout=60)
            assert got.token_ids == hf_greedy(path, prompts[2], 5)
            assert await _prefills(c) == {"local": 2, "remote": 0}
            await _decode_conserved(c)

    asyncio.run(body())


def test_an_idle_engine_takes_a_longer_prompt_than_a_busy_one() -> None:
    """The idle rule: with no live request, a prompt up to `idle_threshold` uncached tokens is
    prefilled here, chunked over steps; beside a live request only the one-step rule holds."""
    from shared.engine.config import EngineConfig
    from shared.engine.core import EngineCore
    from shared.engine.roles.decode_role import DecodeSettings
    from shared.engine.scheduling.placement import PlacementPolicy

    def engine(threshold: int) -> EngineCore:
        policy = PlacementPolicy(threshold, 1024)
        config = EngineConfig(model="tiny", num_kv_blocks=256, max_num_tokens=64)
        return EngineCore(config, role=DecodeSettings(policy, max_inflight=8))

    core, off = engine(32), engine(0)

    def ids(n: int, seed: int) -> list[int]:
        return [3 + (seed + 7 * i) % 250 for i in range(n)]  # the tiny model's vocab is 259

    params = SamplingParams(max_tokens=2)

    def local(prompt: list[int], rid: str, on: EngineCore) -> LlmRequest | None:
        hashes = compute_block_hashes(prompt, on.kv_manager.block_size)
        return on.role.placement.try_local(prompt, params, rid, hashes, 0)  # type: ignore[attr-defined]

    assert local(ids(1100, 2), "x", core) is None
    assert local(ids(600, 0), "off", off) is None  # 0: off
    # 600 tokens: past one 64-token step and the 32-token rule, within the idle bound: taken
    taken = local(ids(600, 0), "idle", core)
    assert taken is not None and taken.prompt_block_hashes  # carried: not hashed again
    # now a request is live: only the one-step rule, and this step's budget is owed to it
    assert local(ids(600, 1), "busy", core) is None
    assert local([5, 6, 7], "short", core) is None
    core.abort("idle")
    core.check_conservation()
