"""n > 1: one prompt, n completions. The prompt is computed and its KV pushed once; the
completions share its full blocks (reference counts) and copy the partial last one; each draws
from its own stream; cancel and timeout end all n; every seat and block comes back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc import aio

from proto.pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore, RequestRejected
from shared.engine.llm import LLM
from shared.engine.resources.block_manager import BlockManager
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.forward_batch import ForwardBatch, SeqEntry
from shared.model.loader import load_model
from shared.serving.wire import sampling_to_proto
from tests.engine_helpers import hf_greedy, random_prompts
from tests.pd_steps import reserve_now
from tests.sampling_reference import pd_generate, same_logprobs
from tests.support.cluster import pd_cluster


def engine(path: Path, **kwargs: object) -> LLM:
    config = EngineConfig(model=str(path), num_kv_blocks=256, **kwargs)  # type: ignore[arg-type]
    return LLM(config, load_model(str(path)))


def test_greedy_n_gives_n_copies_of_the_greedy_completion(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    prompt = random_prompts(1, 512, min_len=21, max_len=21, seed=3)[0]
    llm = engine(path)
    outs = llm.generate([prompt], SamplingParams(max_tokens=12, n=3))
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(o.token_ids == hf_greedy(path, prompt, 12) for o in outs)
    llm.check_conservation()


def test_completions_share_full_prompt_blocks_and_copy_the_partial_one(
    checkpoint: Callable[..., Path],
) -> None:
    path = checkpoint("qwen2")
    prompt = random_prompts(1, 512, min_len=40, max_len=40, seed=5)[0]  # 2 full blocks + 8
    llm = engine(path)
    llm.add_request(prompt, SamplingParams(max_tokens=30, n=4, temperature=1.0, seed=9))
    core = llm.core
    while len(core.requests) < 4:
        core.step()
    tables = [core.kv_manager.block_table(rid) for rid in sorted(core.requests)]
    full = [t[:2] for t in tables]
    assert all(f == full[0] for f in full)
    assert all(core.kv_manager.blocks.ref_count(b) == 4 for b in full[0])
    partial = {t[2] for t in tables}
    assert len(partial) == 4  # each completion writes its own tokens into its own copy
    while core.has_work:
        core.step()
    llm.check_conservation()


def test_seeded_n_streams_differ_and_match_across_batches(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("qwen2")
    prompts = random_prompts(3, 512, min_len=5, max_len=50, seed=7)
    params = SamplingParams(max_tokens=10, n=4, temperature=1.0, seed=11, logprobs=2)
    llm = engine(path)
    alone = llm.generate([prompts[0]], params)
    assert len({tuple(o.token_ids) for o in alone}) > 1  # own streams
    batched = llm.generate(prompts, [params, SamplingParams(max_tokens=5, seed=1), params])
    for a, b in zip(alone, batched[:4], strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs is not None and b.logprobs is not None
        assert same_logprobs(a.logprobs, b.logprobs)
    llm.check_conservation()


def test_pd_n4_pushes_prompt_once_and_matches_colocated(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("qwen2")
    prompt = random_prompts(1, 512, min_len=70, max_len=70, seed=13)[0]  # 5 blocks
    params = SamplingParams(
        max_tokens=12,
        n=4,
        temperature=0.9,
        seed=17,
        logprobs=3,
        prompt_logprobs=1,
        repetition_penalty=1.2,
    )
    want = engine(path).generate([prompt], params)

    async def body() -> None:
        async with pd_cluster(path, num_prefill=2) as c:
            node = c.decodes[0]
            before = (await asyncio.to_thread(c.metrics))[-1].get(
                "pdserve_kv_transfer_bytes_total", 0.0
            )
            got = await pd_generate(c.targets[0], prompt, params)
            assert len(got) == 4
            for g, w in zip(got, want, strict=True):
                assert g.token_ids == w.token_ids
                assert w.logprobs is not None and same_logprobs(g.logprobs, w.logprobs)
            assert got[0].prompt_logprobs is not None and len(got[0].prompt_logprobs) == 70
            block_bytes = node.core.layout.block_bytes_per_layer * node.core.layout.num_layers
            after = (await asyncio.to_thread(c.metrics))[-1]["pdserve_kv_transfer_bytes_total"]
            assert after - before == 5 * block_bytes  # one prompt's KV, not four
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def _request(prompt: list[int], params: SamplingParams) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=prompt), sampling=sampling_to_proto(params)
    )


def test_pd_n4_cancel_mid_stream_and_timeout_release_everything(
    checkpoint: Callable[..., Path],
) -> None:
    path = checkpoint("llama")
    prompt = random_prompts(1, 512, min_len=30, max_len=30, seed=19)[0]
    params = SamplingParams(
        max_tokens=200,
        n=4,
        temperature=1.0,
        seed=3,
        ignore_eos=True,
        logprobs=2,
        repetition_penalty=1.2,
        logit_bias={7: 1.0},
    )

    async def body() -> None:
        async with pd_cluster(path) as c:
            async with aio.insecure_channel(c.targets[0]) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                call = stub.Generate(_request(prompt, params), timeout=60)
                seen: set[int] = set()
                async for msg in call:
                    seen.add(msg.index)
                    if len(seen) == 4:
                        break
                call.cancel()
                await c.assert_idle_and_conserved()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    slow = SamplingParams(
                        max_tokens=900, n=4, temperature=1.0, seed=4, ignore_eos=True
                    )
                    async for _ in stub.Generate(_request(prompt, slow), timeout=1.0):
                        pass
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await c.assert_idle_and_conserved()
            # still serving: a fresh n = 2 completes
            done = await pd_generate(c.targets[0], prompt, SamplingParams(max_tokens=4, n=2))
            assert [d.token_ids for d in done] == [hf_greedy(path, prompt, 4)] * 2
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def test_n_bounds_rejected(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    llm = engine(path, max_batch_size=4)
    with pytest.raises(RequestRejected, match=r"sampling\.n"):
        llm.generate([[5, 6, 7]], SamplingParams(n=5))
    with pytest.raises(RequestRejected, match=r"sampling\.n"):
        llm.generate([[5, 6, 7]], SamplingParams(n=0))
    llm.check_conservation()


def test_fork_without_a_free_block_recomputes_and_matches(checkpoint: Callable[..., Path]) -> None:
    """Decode side: the KV landed but no block is free for a completion's partial-block copy;
    that completion holds nothing, recomputes its prompt when blocks free up, and still gives
    the greedy completion."""
    path = checkpoint("llama")
    config = EngineConfig(model=str(path), num_kv_blocks=5, max_batch_size=2)
    core = EngineCore(config, load_model(str(path)), role=DecodeSettings())
    prompt = random_prompts(1, 512, min_len=40, max_len=40, seed=23)[0]  # 2 full blocks + 8
    params = SamplingParams(max_tokens=6, n=2)
    want = hf_greedy(path, prompt, 6)
    reserve_now(core, prompt, params, "P")
    reserve_now(core, [5, 6, 7, 8, 9] * 6, SamplingParams(max_tokens=2), "Q")  # 2
    assert core.kv_manager.num_free_blocks == 0
    # the KV "landed": write the prompt's K/V as the prefill node would have
    batch = ForwardBatch.build(
        [SeqEntry(prompt, 0, core.kv_manager.block_table("P"))], 16, core.device
    )
    core.model.forward(batch, core.kv_pool)
    deltas = core.role.complete_transfer("P", want[0], choices=[(want[0], None)])
    assert [d.index for d in deltas] == [0, 1]
    assert core.kv_manager.block_table("P#1") == []  # nothing free for the copy
    core.role.fail_transfer("Q")
    tokens: dict[int, list[int]] = {0: [want[0]], 1: [want[0]]}
    while core.has_work:
        for d in core.step():
            tokens[d.index].extend(d.token_ids)
    assert tokens == {0: want, 1: want}
    core.check_conservation()


def test_shared_blocks_are_reference_counted() -> None:
    """Each completion's free drops one reference; a block returns to its pool with the last."""
    bm = BlockManager(4, 16)
    blocks = bm.allocate(2)
    bm.share(blocks)
    bm.share(blocks)
    assert [bm.ref_count(b) for b in blocks] == [3, 3]
    bm.free(blocks)
    bm.free(blocks)
    assert bm.num_free_blocks == 2 and all(bm.ref_count(b) == 1 for b in blocks)
    bm.free(blocks)
    bm.check_all_free()
    with pytest.raises(AssertionError, match="nobody holds"):
        bm.share(blocks)
    with pytest.raises(AssertionError, match="double free"):
        bm.free(blocks)
