"""The disaggregated path in one process: real gRPC servers, real UCX, real torch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from pdserve.client import generate
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.requests.request import LlmRequestState
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.engine_helpers import hf_greedy, random_max_tokens, random_prompts
from tests.support.cluster import pd_cluster

S = LlmRequestState


def run(coro):
    return asyncio.run(coro)


def test_greedy_parity_lifecycle_and_chunked_prefill(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    prompts = random_prompts(12, 512, min_len=1, max_len=200, seed=11)
    max_tokens = random_max_tokens(12, hi=24, seed=12)
    # a prefill budget of 48 tokens splits the longer prompts into several chunks
    prefill = EngineConfig(model=str(path), num_kv_blocks=1024, max_num_tokens=48)

    async def body() -> None:
        async with pd_cluster(path, prefill_engine=prefill) as c:
            results = await asyncio.gather(
                *(
                    generate(c.targets[0], p, max_tokens=m, timeout=120)
                    for p, m in zip(prompts, max_tokens, strict=True)
                )
            )
            for p, m, r in zip(prompts, max_tokens, results, strict=True):
                assert r.token_ids == hf_greedy(path, p, m)
                assert r.usage.prompt_tokens == len(p)
                assert r.usage.completion_tokens == len(r.token_ids) <= m
            histories = dict(c.decodes[0].core.recent_history)
            for r in results:
                check_decode_lifecycle(histories[r.request_id], single_token=len(r.token_ids) == 1)
            await c.assert_idle_and_conserved()

    run(body())


def check_decode_lifecycle(history: list[tuple[S, int | None]], single_token: bool) -> None:
    assert history[0] == (S.QUEUED, None)  # admission: holds nothing until blocks are free
    history = history[1:]
    states = [s for s, _ in history]
    head = [
        S.DISAGG_GENERATION_INIT,
        S.DISAGG_GENERATION_TRANS_IN_PROGRESS,
        S.DISAGG_GENERATION_TRANS_COMPLETE,
    ]
    assert states[:3] == head
    # no seat until the KV has arrived
    assert all(seat is None for _, seat in history[:3])
    if single_token:
        assert states[3:] == [S.GENERATION_COMPLETE]
    else:
        assert states[3:] == [S.GENERATION_IN_PROGRESS, S.GENERATION_COMPLETE]
        assert history[3][1] is not None  # seated exactly when decoding starts


def test_seeded_sampling_matches_colocated(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("qwen2")
    prompts = random_prompts(6, 512, min_len=5, max_len=120, seed=21)
    params = [
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=40, seed=1000 + i)
        for i in range(6)
    ]
    colocated = LLM(EngineConfig(model=str(path), num_kv_blocks=512), load_model(str(path)))
    want = [o.token_ids for o in colocated.generate(prompts, params)]

    async def body() -> None:
        async with pd_cluster(path) as c:
            got = await asyncio.gather(
                *(
                    generate(
                        c.targets[0],
                        p,
                        max_tokens=20,
                        temperature=0.9,
                        top_p=0.95,
                        top_k=40,
                        seed=sp.seed,
                    )
                    for p, sp in zip(prompts, params, strict=True)
                )
            )
            assert [g.token_ids for g in got] == want
            await c.assert_idle_and_conserved()

    run(body())


def test_seats_exhausted_transferred_requests_wait_seatless(
    checkpoint: Callable[..., Path],
) -> None:
    path = checkpoint("llama")
    prompts = random_prompts(10, 512, min_len=10, max_len=80, seed=31)
    decode = EngineConfig(model=str(path), num_kv_blocks=1024, max_batch_size=2)

    async def body() -> None:
        async with pd_cluster(path, decode_engine=decode) as c:
            results = await asyncio.gather(
                *(generate(c.targets[0], p, max_tokens=16, timeout=120) for p in prompts)
            )
            for p, r in zip(prompts, results, strict=True):
                assert r.token_ids == hf_greedy(path, p, 16)
            await c.assert_idle_and_conserved()

    run(body())


def test_layerwise_push_overlaps_compute_and_prefix_hit_sends_only_missing(
    checkpoint: Callable[..., Path],
) -> None:
    path = checkpoint("llama", num_hidden_layers=3)
    shared = random_prompts(1, 512, min_len=96, max_len=96, seed=41)[0]
    long_prompt = random_prompts(1, 512, min_len=400, max_len=400, seed=42)[0]
    prefill = EngineConfig(model=str(path), num_kv_blocks=1024, max_num_tokens=64)

    async def body() -> None:
        async with pd_cluster(path, prefill_engine=prefill) as c:
            node = c.decodes[0]
            r = await generate(c.targets[0], long_prompt, max_tokens=4, timeout=120)
            stats = node.transfer_log[r.request_id].stats
            # the first layers left before the last layer of the prompt was computed
            assert 0 < stats.first_layer_sent_unix < stats.last_layer_computed_unix
            assert stats.messages > node.core.layout.num_layers  # several chunks x layers
            assert r.token_ids == hf_greedy(path, long_prompt, 4)

            first = await generate(c.targets[0], [*shared, 5, 6, 7], max_tokens=2)
            second = await generate(c.targets[0], [*shared, 9, 9], max_tokens=2)
            block_bytes = node.core.layout.block_bytes_per_layer * node.core.layout.num_layers
            bytes_first = node.transfer_log[first.request_id].stats.bytes_sent
            bytes_second = node.transfer_log[second.request_id].stats.bytes_sent
            assert bytes_first == 7 * block_bytes  # 99 tokens = 7 blocks of 16
            assert second.usage.cached_tokens == 96  # 6 full blocks already on the decode node
            assert bytes_second == 1 * block_bytes  # only the block holding the new tokens
            assert second.token_ids == hf_greedy(path, [*shared, 9, 9], 2)
            await c.assert_idle_and_conserved()

    run(body())


def test_auto_push_from_a_prefill_node_on_this_host_is_whole(
    checkpoint: Callable[..., Path],
) -> None:
    """--push auto (the default): a prefill node on this host pushes into a CPU pool once, after
    the prompt's last chunk (layer-wise, each of its 5 chunks would go as its own messages); the
    same tokens as the layer-wise push."""
    path = checkpoint("llama", num_hidden_layers=3)
    prompt = random_prompts(1, 512, min_len=300, max_len=300, seed=43)[0]
    prefill = EngineConfig(model=str(path), num_kv_blocks=1024, max_num_tokens=64)

    async def body() -> None:
        overrides = {"push": "auto"}
        async with pd_cluster(path, prefill_engine=prefill, decode_overrides=overrides) as c:
            node = c.decodes[0]
            r = await generate(c.targets[0], prompt, max_tokens=4, timeout=120)
            stats = node.transfer_log[r.request_id].stats
            layout = node.core.layout
            assert stats.messages <= layout.num_layers  # no message per chunk
            assert stats.bytes_sent == 19 * layout.block_bytes_per_layer * layout.num_layers
            assert r.token_ids == hf_greedy(path, prompt, 4)
            await c.assert_idle_and_conserved()

    run(body())


def test_layout_mismatch_fails_precondition_and_node_stays_up(
    checkpoint: Callable[..., Path],
) -> None:
    path = checkpoint("llama")
    prefill = EngineConfig(model=str(path), num_kv_blocks=1024, block_size=8)

    async def body() -> None:
        async with pd_cluster(path, prefill_engine=prefill) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(c.targets[0], [5, 6, 7], max_tokens=2)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "block_size=16" in err.value.details()
            assert "block_size=8" in err.value.details()
            info = await __import__("pdserve.client", fromlist=["x"]).get_model_info(c.targets[0])
            assert info.block_size == 16
            await c.assert_idle_and_conserved()

    run(body())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [5, 99999]}, "99999"),
        ({"prompt": [5] * 1000, "max_tokens": 100}, "context"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop": tuple(f"s{i}" for i in range(40))}, "stop"),
    ],
)
def test_bad_input_is_invalid_argument(
    kwargs: dict[str, object], field: str, checkpoint: Callable[..., Path]
) -> None:
    path = checkpoint("llama")
    args: dict[str, object] = {"prompt": [5, 6, 7], "max_tokens": 4, **kwargs}
    prompt = args.pop("prompt")

    async def body() -> None:
        async with pd_cluster(path) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(c.targets[0], prompt, **args)  # type: ignore[arg-type]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.value.details()
            ok = await generate(c.targets[0], [5, 6, 7], max_tokens=3)
            assert ok.token_ids == hf_greedy(path, [5, 6, 7], 3)
            await c.assert_idle_and_conserved()

    run(body())
