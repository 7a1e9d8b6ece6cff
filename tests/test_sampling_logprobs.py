"""Logprobs of generated and prompt tokens equal transformers' log_softmax of its logits (fp32,
within 1e-4), top-k alternatives in the same order, colocated (LLM) and through P/D."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.engine.config import EngineConfig
from shared.engine.core import RequestRejected
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.engine_helpers import random_prompts
from tests.sampling_reference import (
    assert_logprobs_match,
    hf_log_softmax,
    pd_generate,
    same_logprobs,
)
from tests.support.cluster import pd_cluster


def check_against_hf(
    path: Path, prompt: list[int], tokens: list[int], lps, prompt_lps, k: int, pk: int | None
) -> None:
    ref = hf_log_softmax(path, prompt + tokens)
    assert [lp.token_id for lp in lps] == tokens
    assert_logprobs_match(lps, ref, [len(prompt) - 1 + i for i in range(len(tokens))], k)
    if pk is None:
        assert prompt_lps is None
        return
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt)
    assert [lp.token_id for lp in prompt_lps[1:]] == prompt[1:]
    assert_logprobs_match(prompt_lps[1:], ref, list(range(len(prompt) - 1)), pk)


def test_llm_logprobs_match_transformers(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    prompts = random_prompts(4, 512, min_len=20, max_len=90, seed=3)
    # a 32-token budget chunks the prompts: prompt logprobs are gathered across chunks
    llm = LLM(
        EngineConfig(model=str(path), num_kv_blocks=256, max_num_tokens=32),
        load_model(str(path)),
    )
    # warm the prefix cache: prompt logprobs must still cover every position
    llm.generate(prompts[:2], SamplingParams(max_tokens=2))
    params = [
        SamplingParams(max_tokens=10, logprobs=5, prompt_logprobs=3),
        SamplingParams(max_tokens=6, logprobs=0, prompt_logprobs=0),
        SamplingParams(max_tokens=8, logprobs=20, temperature=0.8, seed=7),
        SamplingParams(max_tokens=5),
    ]
    outs = llm.generate(prompts, params)
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        if sp.logprobs is None:
            assert out.logprobs is None and out.prompt_logprobs is None
            continue
        check_against_hf(
            path,
            prompt,
            out.token_ids,
            out.logprobs,
            out.prompt_logprobs,
            sp.logprobs,
            sp.prompt_logprobs,
        )
    assert outs[0].cached_tokens == 0  # prompt logprobs bypass the prefix cache
    llm.check_conservation()


def test_pd_logprobs_match_transformers_and_colocated(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("qwen2")
    prompts = random_prompts(6, 512, min_len=10, max_len=70, seed=5)
    params = [
        SamplingParams(
            max_tokens=8,
            logprobs=i % 4 * 3,
            prompt_logprobs=None if i % 2 else 2,
            temperature=0.0 if i < 3 else 0.9,
            seed=100 + i,
        )
        for i in range(6)
    ]
    llm = LLM(EngineConfig(model=str(path), num_kv_blocks=256), load_model(str(path)))
    want = llm.generate(prompts, params)
    prefill = EngineConfig(model=str(path), num_kv_blocks=512, max_num_tokens=24)

    async def body() -> None:
        async with pd_cluster(path, num_prefill=2, prefill_engine=prefill) as c:
            got = await asyncio.gather(
                *(pd_generate(c.targets[0], p, sp) for p, sp in zip(prompts, params, strict=True))
            )
            for prompt, sp, (g,), w in zip(prompts, params, got, want, strict=True):
                assert g.token_ids == w.token_ids
                check_against_hf(
                    path,
                    prompt,
                    g.token_ids,
                    g.logprobs,
                    g.prompt_logprobs,
                    sp.logprobs or 0,
                    sp.prompt_logprobs,
                )
                assert w.logprobs is not None
                assert same_logprobs(g.logprobs, w.logprobs)
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def test_prompt_logprobs_survive_preemption(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("mistral")
    prompts = random_prompts(8, 512, min_len=30, max_len=100, seed=8)
    # 30 blocks of 16 tokens cannot hold all eight at once: the newest get preempted, some
    # mid-prompt (a 40-token budget chunks the prompts)
    llm = LLM(
        EngineConfig(model=str(path), num_kv_blocks=30, max_batch_size=8, max_num_tokens=40),
        load_model(str(path)),
    )
    params = SamplingParams(max_tokens=40, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0
    for prompt, out in zip(prompts, outs, strict=True):
        check_against_hf(path, prompt, out.token_ids, out.logprobs, out.prompt_logprobs, 2, 2)
    llm.check_conservation()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
    ],
)
def test_logprobs_bounds_rejected(params: SamplingParams, field: str) -> None:
    llm = LLM(EngineConfig(model="tiny", num_kv_blocks=64))
    with pytest.raises(RequestRejected, match=field):
        llm.generate([[5, 6, 7]], params)
    llm.check_conservation()
