"""Penalties and constraints, batched in the sampler's per-seat rows: repetition_penalty equals
transformers' generate, presence/frequency/logit_bias equal OpenAI's formula applied to
transformers' logits, min_tokens holds EOS back, stop_token_ids end with "stop"; colocated and
through P/D, with conservation after each."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.requests.request import FinishReason
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.engine_helpers import _hf_model, hf_greedy, random_prompts
from tests.sampling_reference import pd_generate
from tests.support.checkpoints import EOS_TOKEN, special_ids
from tests.support.cluster import pd_cluster

EOS = special_ids()[EOS_TOKEN]


def openai_reference(
    path: Path,
    prompt: list[int],
    max_tokens: int,
    presence: float,
    frequency: float,
    bias: dict[int, float],
) -> list[int]:
    """Greedy over transformers' logits reshaped by OpenAI's formula:
    logit[t] += bias[t] - count[t] * frequency - (count[t] > 0) * presence."""
    model = _hf_model(str(path))
    out: list[int] = []
    counts = torch.zeros(model.config.vocab_size)
    for _ in range(max_tokens):
        with torch.inference_mode():
            raw = model(torch.tensor([prompt + out])).logits[0, -1].float()
        logits = raw.clone()  # a normal tensor: updated in place below
        for t, b in bias.items():
            logits[t] += b
        logits -= counts * frequency + (counts > 0).float() * presence
        token = int(logits.argmax())
        out.append(token)
        counts[token] += 1
        if token == EOS:
            break
    return out


def engine(path: Path, **kwargs: object) -> LLM:
    config = EngineConfig(model=str(path), num_kv_blocks=256, **kwargs)  # type: ignore[arg-type]
    return LLM(config, load_model(str(path)))


def test_repetition_penalty_equals_transformers(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("qwen2")
    prompts = random_prompts(6, 512, min_len=3, max_len=60, seed=13)
    llm = engine(path)
    params = SamplingParams(max_tokens=24, repetition_penalty=1.3)
    # mixed with unpenalised requests: only the penalised rows are reshaped
    outs = llm.generate(prompts + prompts[:2], [params] * 6 + [SamplingParams(max_tokens=24)] * 2)
    for prompt, out in zip(prompts, outs, strict=False):
        assert out.token_ids == hf_greedy(path, prompt, 24, repetition_penalty=1.3)
    for prompt, out in zip(prompts[:2], outs[6:], strict=True):
        assert out.token_ids == hf_greedy(path, prompt, 24)
    llm.check_conservation()


def test_presence_frequency_and_logit_bias_follow_openai(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    prompts = random_prompts(3, 512, min_len=5, max_len=40, seed=17)
    cases = [
        (1.5, 0.0, {}),
        (0.0, 1.2, {7: 3.0, 300: -100.0}),
        (-0.5, 0.8, {11: 5.0}),
    ]
    llm = engine(path)
    params = [
        SamplingParams(max_tokens=16, presence_penalty=p, frequency_penalty=f, logit_bias=b)
        for p, f, b in cases
    ]
    outs = llm.generate(prompts, params)
    for prompt, (p, f, b), out in zip(prompts, cases, outs, strict=True):
        assert out.token_ids == openai_reference(path, prompt, 16, p, f, b)
    llm.check_conservation()


def test_min_tokens_holds_eos_and_stop_ids_back(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    llm = engine(path)
    prompt = [5, 6, 7, 8]
    eager = SamplingParams(max_tokens=12, logit_bias={EOS: 100.0})
    held = SamplingParams(max_tokens=12, logit_bias={EOS: 100.0}, min_tokens=5)
    stop_held = SamplingParams(
        max_tokens=12, logit_bias={42: 100.0}, stop_token_ids=(42,), min_tokens=3
    )
    a, b, c = llm.generate([prompt] * 3, [eager, held, stop_held])
    assert a.token_ids == [EOS] and a.finish_reason == FinishReason.STOP
    assert EOS not in b.token_ids[:5] and b.token_ids[5:] == [EOS]
    assert b.finish_reason == FinishReason.STOP
    assert 42 not in c.token_ids[:3] and c.token_ids[3:] == [42]
    assert c.finish_reason == FinishReason.STOP
    llm.check_conservation()


def test_stop_token_ids_end_with_stop(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("qwen2")
    prompt = random_prompts(1, 512, min_len=10, max_len=10, seed=19)[0]
    llm = engine(path)
    free = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    # the last position whose token did not occur before: the stop id first appears there
    stop_at = max(i for i, t in enumerate(free) if t not in free[:i])
    assert stop_at > 0
    stop_id = free[stop_at]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,))
    )[0]
    assert out.token_ids == free[: stop_at + 1]
    assert out.finish_reason == FinishReason.STOP
    llm.check_conservation()


def test_pd_penalties_match_colocated_and_references(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("qwen2")
    prompts = random_prompts(5, 512, min_len=5, max_len=50, seed=23)
    params = [
        SamplingParams(max_tokens=16, repetition_penalty=1.3),
        SamplingParams(max_tokens=16, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(max_tokens=10, logit_bias={EOS: 100.0}, min_tokens=4),
        # the first token comes from the prefill node: a stop id there ends at once
        SamplingParams(max_tokens=10, logit_bias={9: 100.0}, stop_token_ids=(9,)),
        SamplingParams(max_tokens=16, logit_bias={20: 4.0}, frequency_penalty=2.0),
    ]
    want = engine(path).generate(prompts, params)

    async def body() -> None:
        async with pd_cluster(path, num_prefill=2) as c:
            got = await asyncio.gather(
                *(pd_generate(c.targets[0], p, sp) for p, sp in zip(prompts, params, strict=True))
            )
            for (g,), w in zip(got, want, strict=True):
                assert g.token_ids == w.token_ids
                assert g.finish_reason.removeprefix("FINISH_REASON_").lower() == (
                    w.finish_reason.value
                )
            assert got[0][0].token_ids == hf_greedy(path, prompts[0], 16, repetition_penalty=1.3)
            assert got[2][0].token_ids[4:] == [EOS] and EOS not in got[2][0].token_ids[:4]
            assert got[3][0].token_ids == [9]
            await c.assert_idle_and_conserved()

    asyncio.run(body())


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(repetition_penalty=-1.0), "repetition_penalty"),
        (SamplingParams(presence_penalty=3.0), "presence_penalty"),
        (SamplingParams(frequency_penalty=-2.5), "frequency_penalty"),
        (SamplingParams(logit_bias={99999: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={5: 101.0}), "logit_bias"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
        (SamplingParams(stop_token_ids=(70000,)), "stop_token_ids"),
        (SamplingParams(logprobs=25), "logprobs"),
    ],
)
def test_bad_sampling_is_invalid_argument(
    params: SamplingParams, field: str, checkpoint: Callable[..., Path]
) -> None:
    path = checkpoint("llama")

    async def body() -> None:
        async with pd_cluster(path) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pd_generate(c.targets[0], [5, 6, 7], params)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.value.details()
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def test_abort_between_steps_clears_penalty_rows(checkpoint: Callable[..., Path]) -> None:
    """An abort arrives outside the step (the engine thread's commands): the seat's penalty
    rows are cleared there and the seat comes back clean."""
    path = checkpoint("llama")
    llm = engine(path)
    params = SamplingParams(
        max_tokens=50,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        logit_bias={5: 2.0},
        min_tokens=3,
        ignore_eos=True,
    )
    request = llm.add_request([5, 6, 7, 8], params)
    for _ in range(4):
        llm.step()
    seat = request.seq_slot
    assert seat is not None
    penalties = llm.core.sampler.penalties
    assert penalties is not None and bool(penalties.active[seat])
    assert bool(penalties.additive[seat].any()) and bool(penalties.seen[seat].any())
    llm.core.abort(request.request_id)
    assert not bool(penalties.active[seat]) and not bool(penalties.additive[seat].any())
    assert not bool(penalties.seen[seat].any()) and not bool(penalties.produced[seat].any())
    assert not bool(penalties.bias_values[seat].any()) and not bool(penalties.stop_ids[seat].any())
    llm.check_conservation()
    (again,) = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6))
    assert again.token_ids == hf_greedy(path, [5, 6, 7, 8], 6)
