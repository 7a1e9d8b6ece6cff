"""The first token streamed from the Prefill response (decode_node/first_token.py) is the delta
the engine computes for it when it takes the landed request: same tokens, text, finish."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from decode_node.first_token import drop_twin, early_first_delta
from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import FinishReason
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.engine_helpers import random_prompts
from tests.pd_steps import reserve_now


def _cases(core: EngineCore, token: int) -> dict[str, SamplingParams]:
    text = core.tokenizer.decode([token]) or "zq"  # EOS decodes to nothing
    return {
        "plain": SamplingParams(max_tokens=8),
        "max_tokens=1": SamplingParams(max_tokens=1),
        "stop string = the token's text": SamplingParams(max_tokens=8, stop=(text,)),
        "stop string the text may grow into": SamplingParams(max_tokens=8, stop=(text + "zq",)),
        "stop string kept": SamplingParams(
            max_tokens=8, stop=(text,), include_stop_str_in_output=True
        ),
        "stop token id": SamplingParams(max_tokens=8, stop_token_ids=(token,)),
        "ignore_eos": SamplingParams(max_tokens=8, ignore_eos=True),
        "min_tokens": SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(token,)),
    }


@pytest.mark.parametrize("token_choice", ["ordinary", "eos"])
def test_early_first_delta_is_the_engines(
    checkpoint: Callable[..., Path], token_choice: str
) -> None:
    path = checkpoint("llama")
    config = EngineConfig(model=str(path), num_kv_blocks=64)
    core = EngineCore(config, load_model(str(path)), role=DecodeSettings())
    prompt = random_prompts(1, 300, min_len=20, max_len=20, seed=5)[0]
    token = min(core.outputs.eos_token_ids) if token_choice == "eos" else 65
    finishes = set()
    for name, params in _cases(core, token).items():
        rid = f"r-{name}"
        reserve_now(core, prompt, params, rid)
        early = early_first_delta(core.outputs, rid, prompt, params, (token, None, None, [], 0))
        engine = core.role.complete_transfer(rid, token)
        assert early is not None
        got = (early.token_ids, early.text, early.finish_reason, early.index)
        assert got == (engine[0].token_ids, engine[0].text, engine[0].finish_reason, 0), name
        assert drop_twin(early, engine) == []
        finishes.add(early.finish_reason)
        core.abort(rid)
        while core.has_work:
            core.step()
    core.check_conservation()
    # the cases bite: some finish on the first token, some go on (EOS wins over max_tokens=1)
    expected = {FinishReason.STOP, None} | (
        {FinishReason.LENGTH} if token_choice == "ordinary" else set()
    )
    assert finishes == expected


def test_n_greater_than_one_keeps_the_engines_path() -> None:
    params = SamplingParams(max_tokens=4, n=2)
    assert early_first_delta(None, "r", [1, 2], params, (5, None, None, [(5, None)], 0)) is None  # type: ignore[arg-type]


def test_a_twin_that_differs_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    early = TokenDelta("r", [5], "a")
    rest = TokenDelta("r", [6], "b")
    assert drop_twin(early, [TokenDelta("r", [5], "b"), rest]) == [rest]
    assert "first delta streamed early" in caplog.text


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_or_kept_streamed_alike(include: bool) -> None:
    """A stop string ends the text cut before it, or (include_stop_str_in_output) right after
    it; the streamed deltas add up to that text whatever the token boundaries."""
    from shared.engine.requests.output import OutputProcessor
    from shared.engine.requests.request import LlmRequest
    from shared.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    params = SamplingParams(max_tokens=40, stop=("END", "ST"), include_stop_str_in_output=include)
    request = LlmRequest("r", [1, 2], params)
    outputs = OutputProcessor(tok, frozenset())
    outputs.add(request)
    streamed, finish = "", None
    for token in tok.encode("hello wEND and STOP", add_special_tokens=False):
        delta = outputs.process(request, token)
        streamed += delta.text
        if delta.finish_reason is not None:
            finish = delta.finish_reason
            break
    assert finish == FinishReason.STOP
    assert streamed == ("hello wEND" if include else "hello w")
