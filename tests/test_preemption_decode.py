"""Preemption on a decode node whose KV pool runs out mid-decode (real 1P+1D cluster).

Long max_tokens and a small decode pool: requests are admitted with blocks for their prompt and
first token only, grow as they decode, and when blocks run out the newest is preempted by full
release, re-queued and recomputed locally. Preemption must be invisible in the output: greedy
and seeded streams equal what each request gives alone in a pool that never runs short.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from pdserve.client import create_channel, generate
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from tests.engine_helpers import random_prompts, single_torch_thread
from tests.support.cluster import pd_cluster

MODEL = "tiny"
VOCAB = 256
N = 8
MAX_NEW = 120
# 16 blocks of 16 = 256 tokens: one request alone (<= 40 + 119 tokens) fits, 8 together do not
SMALL = EngineConfig(model=MODEL, num_kv_blocks=16, block_size=16, max_batch_size=8)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(EngineConfig(model=MODEL, num_kv_blocks=2048))


def params(i: int, seeded: bool) -> SamplingParams:
    if seeded:
        return SamplingParams(
            max_tokens=MAX_NEW, temperature=0.8, top_k=40, seed=4242 + i, ignore_eos=True
        )
    return SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_decode_preemption_keeps_every_output_exact(reference: LLM, seeded: bool) -> None:
    prompts = random_prompts(N, VOCAB, min_len=10, max_len=40, seed=180 + seeded)
    sp = [params(i, seeded) for i in range(N)]
    want = [o.token_ids for o in reference.generate(prompts, sp)]

    async def body() -> None:
        async with pd_cluster(MODEL, decode_engine=SMALL) as c:
            channel = create_channel(c.targets[0])
            try:
                got = await asyncio.gather(
                    *(
                        generate(
                            c.targets[0],
                            p,
                            max_tokens=s.max_tokens,
                            temperature=s.temperature,
                            top_k=s.top_k,
                            seed=s.seed,
                            ignore_eos=True,
                            timeout=300,
                            channel=channel,
                        )
                        for p, s in zip(prompts, sp, strict=True)
                    )
                )
            finally:
                await channel.close()
            assert [g.token_ids for g in got] == want
            decode = (await asyncio.to_thread(c.metrics))[1]
            assert decode["pdserve_preemptions_total"] > 0, "the pool never ran short"
            await c.assert_idle_and_conserved()

    asyncio.run(body())
