"""With a seed, every sampling feature gives identical tokens and logprobs via P/D (two prefill
nodes), colocated, alone and inside a batch of 32 mixed requests."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

from shared.engine.config import EngineConfig
from shared.engine.core import RequestOutput
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.engine_helpers import random_prompts
from tests.sampling_reference import Completion, pd_generate, same_logprobs
from tests.support.checkpoints import EOS_TOKEN, special_ids
from tests.support.cluster import pd_cluster

EOS = special_ids()[EOS_TOKEN]
FEATURES: list[dict[str, object]] = [
    {"logprobs": 5, "prompt_logprobs": 2},
    {"repetition_penalty": 1.3},
    {"presence_penalty": 1.2, "frequency_penalty": 0.7},
    {"logit_bias": {EOS: 4.0, 33: 3.0}, "min_tokens": 6},
    {"stop_token_ids": (40, 41, 42, 43, 44, 45)},
    {"top_k": 20, "top_p": 0.9, "logprobs": 0},
    {"n": 4, "logprobs": 2, "frequency_penalty": 0.5},
    {"min_p": 0.15, "top_p": 0.95},
]


def mixed_params(n: int, seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        features = FEATURES[i % len(FEATURES)]
        out.append(
            SamplingParams(
                max_tokens=rng.randint(8, 20),
                temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
                seed=rng.randrange(2**32),
                **features,  # type: ignore[arg-type]
            )
        )
    return out


def by_request(outputs: list[RequestOutput]) -> list[list[RequestOutput]]:
    """LLM.generate's flat list (n consecutive outputs per prompt) grouped per prompt."""
    groups: list[list[RequestOutput]] = []
    for out in outputs:
        if out.index == 0:
            groups.append([])
        groups[-1].append(out)
    return groups


def assert_same(got: Completion | RequestOutput, want: RequestOutput) -> None:
    assert got.token_ids == want.token_ids
    if want.logprobs is not None:
        assert got.logprobs is not None and same_logprobs(got.logprobs, want.logprobs)
    if want.prompt_logprobs is not None:
        assert got.prompt_logprobs is not None
        assert same_logprobs(got.prompt_logprobs[1:], want.prompt_logprobs[1:])  # type: ignore[arg-type]


def test_seeded_features_identical_pd_colocated_alone_and_batched(
    checkpoint: Callable[..., Path],
) -> None:
    path = checkpoint("qwen2")
    prompts = random_prompts(32, 512, min_len=4, max_len=80, seed=29)
    params = mixed_params(32, seed=31)
    llm = LLM(EngineConfig(model=str(path), num_kv_blocks=512), load_model(str(path)))
    batched = by_request(llm.generate(prompts, params))
    assert [len(b) for b in batched] == [p.n for p in params]
    for i in range(len(FEATURES)):  # each feature alone equals itself inside the batch
        alone = llm.generate([prompts[i]], [params[i]])
        for a, b in zip(alone, batched[i], strict=True):
            assert_same(a, b)
    llm.check_conservation()
    prefill = EngineConfig(model=str(path), num_kv_blocks=512, max_num_tokens=40)

    async def body() -> None:
        async with pd_cluster(path, num_prefill=2, prefill_engine=prefill) as c:
            got = await asyncio.gather(
                *(pd_generate(c.targets[0], p, sp) for p, sp in zip(prompts, params, strict=True))
            )
            for g, w in zip(got, batched, strict=True):
                assert len(g) == len(w)
                for a, b in zip(g, w, strict=True):
                    assert_same(a, b)
            for i in (3, 6):  # min_tokens, and n = 4, alone
                alone = await pd_generate(c.targets[0], prompts[i], params[i])
                for a, b in zip(alone, batched[i], strict=True):
                    assert_same(a, b)
            await c.assert_idle_and_conserved()

    asyncio.run(body())
