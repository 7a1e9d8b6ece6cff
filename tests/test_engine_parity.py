"""Colocated engine vs transformers, token for token (greedy), with conservation after each."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.engine_helpers import hf_greedy, random_max_tokens, random_prompts

ARCHES = ["llama", "llama3", "qwen2", "mistral"]


def run_and_compare(
    path: Path, config: EngineConfig, prompts: list[list[int]], max_tokens: list[int]
) -> LLM:
    engine = LLM(config, load_model(str(path)))
    params = [SamplingParams(max_tokens=m) for m in max_tokens]
    outputs = engine.generate(prompts, params)
    for prompt, m, out in zip(prompts, max_tokens, outputs, strict=True):
        assert out.token_ids == hf_greedy(path, prompt, m), f"prompt of {len(prompt)} tokens"
    engine.check_conservation()
    return engine


@pytest.mark.parametrize("arch", ARCHES)
def test_greedy_parity_16_concurrent(arch: str, checkpoint: Callable[..., Path]) -> None:
    path = checkpoint(arch)
    prompts = random_prompts(16, 512, seed=hash(arch) % 1000)
    max_tokens = random_max_tokens(16)
    config = EngineConfig(model=str(path), num_kv_blocks=1024, max_batch_size=16)
    run_and_compare(path, config, prompts, max_tokens)


def test_chunked_prefill_smaller_than_prompt(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    prompts = random_prompts(6, 512, min_len=100, max_len=300, seed=3)
    config = EngineConfig(
        model=str(path), num_kv_blocks=512, max_batch_size=8, max_num_tokens=48, block_size=8
    )
    engine = run_and_compare(path, config, prompts, random_max_tokens(6, seed=4))
    assert engine.core.num_steps > sum(len(p) for p in prompts) // 48


def test_prefix_cache_hits_shared_system_prompt(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("qwen2")
    system = random_prompts(1, 512, min_len=64, max_len=64, seed=5)[0]
    config = EngineConfig(model=str(path), num_kv_blocks=512, max_batch_size=8)
    engine = LLM(config, load_model(str(path)))
    warm = engine.generate([[*system, 7, 8, 9]], SamplingParams(max_tokens=2))
    assert warm[0].cached_tokens == 0
    prompts = random_prompts(8, 512, min_len=1, max_len=40, seed=6, prefix=system)
    max_tokens = random_max_tokens(8, hi=24, seed=7)
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    for prompt, m, out in zip(prompts, max_tokens, outputs, strict=True):
        assert out.cached_tokens >= 64
        assert out.token_ids == hf_greedy(path, prompt, m)
    engine.check_conservation()


def test_parity_under_preemption(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("mistral")
    prompts = random_prompts(12, 512, min_len=20, max_len=120, seed=8)
    max_tokens = random_max_tokens(12, lo=32, hi=64, seed=9)
    # 40 blocks of 16 tokens cannot hold all twelve at once: the newest get preempted
    config = EngineConfig(model=str(path), num_kv_blocks=40, max_batch_size=12)
    engine = LLM(config, load_model(str(path)))
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    assert sum(o.num_preemptions for o in outputs) > 0
    for prompt, m, out in zip(prompts, max_tokens, outputs, strict=True):
        assert out.token_ids == hf_greedy(path, prompt, m)
    engine.check_conservation()
