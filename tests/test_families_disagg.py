"""Qwen3, Gemma 2, Gemma 3 and Phi-3 through the disaggregated path: two prefill nodes over the
public gRPC API, KV pushed layer by layer over UCX to a decode node, greedy tokens equal to
transformers' (real gRPC servers, real UCX, real torch)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.client import generate
from shared.engine.config import EngineConfig
from tests.engine_helpers import hf_greedy, random_max_tokens, random_prompts
from tests.support.cluster import pd_cluster
from tests.test_families_parity import VARIANTS

PD_VARIANTS = [
    "qwen3-mqa-tied-window",
    "gemma2-softcap",
    "gemma3-mqa-untied",
    "phi3-partial-rotary-window",
]


@pytest.mark.parametrize("name", PD_VARIANTS)
def test_two_prefill_nodes_match_transformers(name: str, checkpoint: Callable[..., Path]) -> None:
    arch, kwargs = VARIANTS[name]
    path = checkpoint(arch, **kwargs)
    prompts = random_prompts(8, 512, min_len=1, max_len=120, seed=len(name))
    max_tokens = random_max_tokens(8, hi=12, seed=len(name) + 1)
    # a prefill budget of 48 tokens splits the longer prompts into several chunks
    prefill = EngineConfig(model=str(path), num_kv_blocks=512, max_num_tokens=48)

    async def body() -> None:
        async with pd_cluster(path, num_prefill=2, prefill_engine=prefill) as c:
            results = await asyncio.gather(
                *(
                    generate(c.targets[0], p, max_tokens=m, timeout=120)
                    for p, m in zip(prompts, max_tokens, strict=True)
                )
            )
            for p, m, r in zip(prompts, max_tokens, results, strict=True):
                assert r.token_ids == hf_greedy(path, p, m), f"prompt of {len(p)} tokens"
            assert all(node.core.num_steps > 0 for node in c.prefills)  # both took prompts
            await c.assert_idle_and_conserved()

    asyncio.run(body())
