"""The start-up warm-up (shared/engine/runtime/warmup.py): its shapes follow the engine's limits,
and it leaves no trace: same tokens as a cold engine, no prefix-cache entries, every block free."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.runtime.warmup import (
    WARMUP_DECODE_BATCH,
    WARMUP_MAX_TOKENS,
    WarmupShape,
    warm_up,
    warmup_shape,
)
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.engine_helpers import random_prompts


def test_warm_up_changes_no_token_and_no_cache(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    loaded = load_model(str(path))
    config = EngineConfig(model=str(path), num_kv_blocks=96, max_batch_size=4)
    prompts = random_prompts(6, 300, min_len=5, max_len=90, seed=9)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cold = [o.token_ids for o in LLM(config, loaded).generate(prompts, params)]

    llm = LLM(config, loaded)
    assert _warm_up(llm) == WarmupShape(512, 4)  # the step budget; batch limited to 4
    llm.core.check_conservation()
    assert llm.core.num_steps == 0 and not llm.core.requests
    assert [o.token_ids for o in llm.generate(prompts, params)] == cold
    # the warm-up's prompt (token 0 repeated) was never entered in the prefix cache
    (zeros,) = llm.generate([[0] * 64], SamplingParams(max_tokens=1))
    assert zeros.cached_tokens == 0
    llm.core.check_conservation()


def test_warmup_shape_respects_context_and_pool(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    loaded = load_model(str(path))
    small_pool = LLM(
        EngineConfig(model=str(path), num_kv_blocks=3, block_size=16, max_batch_size=2), loaded
    )
    assert _shape(small_pool) == WarmupShape(48, 2)
    assert _warm_up(small_pool).prefill_tokens == 48
    short = LLM(EngineConfig(model=str(path), num_kv_blocks=96, max_model_len=100), loaded)
    assert _shape(short) == WarmupShape(100, WARMUP_DECODE_BATCH)
    big_budget = LLM(EngineConfig(model=str(path), num_kv_blocks=1024, max_num_tokens=8192), loaded)
    assert _shape(big_budget).prefill_tokens == WARMUP_MAX_TOKENS
    assert _warm_up(short).prefill_tokens == 100


def test_warm_up_refuses_a_busy_engine(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    llm = LLM(EngineConfig(model=str(path), num_kv_blocks=32), load_model(str(path)))
    llm.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        _warm_up(llm)


def _warm_up(llm: LLM) -> WarmupShape:
    return warm_up(llm.core.parts, llm.core.max_model_len)


def _shape(llm: LLM) -> WarmupShape:
    return warmup_shape(llm.core.parts, llm.core.max_model_len)
