"""Window-aware KV transfer (shared/model/kv_window.py) on a Gemma-3-shaped model (five
sliding-window layers to one global, window shorter than the prompts): the prefill node leaves
out the blocks that fell out of each window layer's window, the decode node still serves
transformers' greedy tokens, the push shrinks by exactly the skipped (layer, block) pairs, and
the decode node never lets a later request read the rows that were never sent: not through its
prefix cache (a shorter prompt sharing the long one's prefix, prefilled on the decode node
itself), not after preemption and recompute (a KV pool too small for the batch)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from pdserve.client import generate
from proto.pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from shared.engine.config import EngineConfig
from shared.kv.layout import KvLayout
from shared.model.kv_window import skipped_blocks, skipped_problem
from tests.engine_helpers import hf_greedy, random_prompts
from tests.support.cluster import pd_cluster

WINDOW, BLOCK = 16, 8
SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA3_SHAPED = {
    "num_hidden_layers": 6,
    "layer_types": [SLIDING] * 5 + [FULL],
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "sliding_window": WINDOW,
}
MAX_TOKENS = 6


def test_skip_counts_follow_the_first_query_position() -> None:
    windows = (WINDOW, None, 4)
    # prompt 100: positions below 84 (window 16) and 96 (window 4) are never read again
    assert skipped_blocks(windows, 100, BLOCK, 0) == (10, 0, 12)
    assert skipped_blocks(windows, 100, BLOCK, 3) == (7, 0, 9)  # 3 blocks were a prefix hit
    assert skipped_blocks(windows, 20, BLOCK, 0) == (0, 0, 2)
    assert skipped_blocks(windows, 11, BLOCK, 0) == ()  # nothing to skip: nothing to tell
    assert skipped_blocks((None, None), 4096, BLOCK, 0) == ()
    # the last block (the next position's neighbours) is never skipped, at any length
    for n in range(1, 200):
        counts = skipped_blocks((1,), n, BLOCK, 0)
        assert not counts or counts[0] < -(-n // BLOCK)
    assert skipped_problem((1, 2), 3, 5) == "skipped_blocks has 2 entries for 3 layers"
    assert skipped_problem((0, 5, 0), 3, 5) is not None
    assert skipped_problem((0, 4, 0), 3, 5) is None


def _engine(path: Path, num_kv_blocks: int = 512) -> EngineConfig:
    return EngineConfig(
        model=str(path), num_kv_blocks=num_kv_blocks, block_size=BLOCK, max_num_tokens=64
    )


async def _pushed_bytes(path: Path, prompt: list[int], window_aware: bool, push: str) -> int:
    overrides = {"window_aware_transfer": window_aware, "push": push}
    async with pd_cluster(
        path, prefill_engine=_engine(path), decode_engine=_engine(path), decode_overrides=overrides
    ) as c:
        result = await generate(c.targets[0], prompt, max_tokens=MAX_TOKENS, request_id="long")
        assert result.token_ids == hf_greedy(path, prompt, MAX_TOKENS)
        await c.assert_idle_and_conserved()
        return c.decodes[0].transfer_log["long"].stats.bytes_sent


@pytest.mark.parametrize("push", ["layerwise", "whole"])
def test_window_layers_push_only_their_window(push: str, checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("gemma3", **GEMMA3_SHAPED)
    [prompt] = random_prompts(1, 512, min_len=100, max_len=100, seed=5)
    full = asyncio.run(_pushed_bytes(path, prompt, window_aware=False, push=push))
    windowed = asyncio.run(_pushed_bytes(path, prompt, window_aware=True, push=push))
    layout = KvLayout(6, 2, 32, BLOCK, "float32")
    blocks = -(-len(prompt) // BLOCK)  # 13
    assert full == layout.payload_bytes(6, blocks)
    # five window layers leave out blocks 0..9 (positions below 100 - 16)
    skipped = 5 * ((len(prompt) - WINDOW) // BLOCK)
    assert full - windowed == skipped * layout.block_bytes_per_layer
    assert windowed == (6 * blocks - skipped) * layout.block_bytes_per_layer


@pytest.mark.parametrize("shared_len", [40, 88])
def test_a_shorter_prompt_never_reuses_rows_that_were_not_sent(
    shared_len: int, checkpoint: Callable[..., Path]
) -> None:
    """The long prompt goes through the prefill node (more than the local-prefill limit); the
    shorter one sharing its first `shared_len` tokens fits the limit and is prefilled on the
    decode node, where a prefix hit on the long prompt's blocks would read window-layer rows
    that never arrived. 88 shares blocks the window layers did send too. A third prompt
    extends the short one past the limit: pushed after a prefix hit on the decode node, its
    skip counts start after the blocks that hit."""
    path = checkpoint("gemma3", **GEMMA3_SHAPED)
    [long] = random_prompts(1, 512, min_len=100, max_len=100, seed=6)
    short = long[:shared_len] + random_prompts(1, 512, min_len=5, max_len=5, seed=7)[0]
    longer = short + random_prompts(1, 512, min_len=110, max_len=110, seed=9)[0]
    overrides = {
        "window_aware_transfer": True,
        "local_prefill_tokens": 96,
        "local_prefill_idle_tokens": 96,
    }

    async def body() -> None:
        async with pd_cluster(
            path,
            prefill_engine=_engine(path),
            decode_engine=_engine(path),
            decode_overrides=overrides,
        ) as c:
            first = await generate(c.targets[0], long, max_tokens=MAX_TOKENS, request_id="long")
            second = await generate(c.targets[0], short, max_tokens=MAX_TOKENS, request_id="short")
            third = await generate(c.targets[0], longer, max_tokens=MAX_TOKENS, request_id="longer")
            assert "long" in c.decodes[0].transfer_log  # pushed, window-aware
            assert "short" not in c.decodes[0].transfer_log  # prefilled on the decode node
            assert first.token_ids == hf_greedy(path, long, MAX_TOKENS)
            assert second.token_ids == hf_greedy(path, short, MAX_TOKENS)
            assert third.token_ids == hf_greedy(path, longer, MAX_TOKENS)
            assert "longer" in c.decodes[0].transfer_log
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def test_preempted_requests_recompute_rather_than_read_skipped_rows(
    checkpoint: Callable[..., Path],
) -> None:
    """Four long prompts pushed window-aware into a decode pool that cannot hold all of them
    for their whole generation: some are preempted and recomputed there, token-exact."""
    path = checkpoint("gemma3", **GEMMA3_SHAPED)
    prompts = random_prompts(4, 512, min_len=90, max_len=100, seed=8)
    tokens = 24

    async def body() -> None:
        async with pd_cluster(
            path,
            prefill_engine=_engine(path),
            decode_engine=_engine(path, num_kv_blocks=56),
            decode_overrides={"window_aware_transfer": True},
        ) as c:
            # whether the four decode side by side (and so run out of blocks) depends on when
            # each lands; on a loaded machine one may finish first: the round is run again
            for _ in range(3):
                results = await asyncio.gather(
                    *(generate(c.targets[0], p, max_tokens=tokens, timeout=120) for p in prompts)
                )
                for p, r in zip(prompts, results, strict=True):
                    assert r.token_ids == hf_greedy(path, p, tokens)
                await c.assert_idle_and_conserved()
                if (await asyncio.to_thread(c.metrics))[-1]["pdserve_preemptions_total"] > 0:
                    break
            assert (await asyncio.to_thread(c.metrics))[-1]["pdserve_preemptions_total"] > 0

    asyncio.run(body())


def test_prefill_node_refuses_skips_that_leave_a_layer_nothing(
    checkpoint: Callable[..., Path],
) -> None:
    path = checkpoint("gemma3", **GEMMA3_SHAPED)

    async def body() -> None:
        async with pd_cluster(path, prefill_engine=_engine(path), num_decode=0) as c:
            node = c.prefills[0]
            destination = prefill_pb2.KvDestination(
                ucx_address="127.0.0.1:1",
                transfer_id=7,
                transfer_token=bytes(16),
                block_ids=range(5),
                layout_fingerprint=node.layout.fingerprint(),
                skipped_blocks=[0, 0, 0, 5, 0, 0],  # a 40-token prompt has 5 blocks
            )
            request = prefill_pb2.PrefillRequest(
                request_id="bad", prompt_token_ids=range(1, 41), destination=destination
            )
            async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await prefill_pb2_grpc.PrefillStub(channel).Prefill(request, timeout=30)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "skipped_blocks 5 leaves none of the 5 blocks" in error.value.details()

    asyncio.run(body())
