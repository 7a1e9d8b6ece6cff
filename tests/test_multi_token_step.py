"""A step may carry several tokens for a request (the seat speculative decoding needs): a role
accepts them in order in one call, and the engine's outputs, stop handling, logprobs and KV
accounting come out as if they had come one step each; the ITL bound counts a step's tokens."""

from __future__ import annotations

import pytest

from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore
from shared.engine.requests.request import FinishReason, LlmRequest, LlmRequestState
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.scheduling.slo import Ewma, SloPolicy

PROMPT = list(range(40, 61))  # 21 tokens: two full 8-token blocks and a partial one


def engine() -> EngineCore:
    config = EngineConfig(model="tiny", block_size=8, num_kv_blocks=32, max_batch_size=4)
    return EngineCore(config, role=DecodeSettings())


def drain(core: EngineCore) -> list[int]:
    tokens: list[int] = []
    for _ in range(200):
        if not core.has_work:
            break
        for delta in core.step():
            tokens.extend(delta.token_ids)
    assert not core.has_work
    return tokens


def one_per_step(params: SamplingParams) -> list[int]:
    core = engine()
    core.add_request(PROMPT, params, "ref")
    tokens = drain(core)
    core.check_conservation()
    return tokens


def first_token(core: EngineCore, params: SamplingParams) -> LlmRequest:
    request = core.add_request(PROMPT, params, "r")
    while not request.output_token_ids:
        core.step()
    return request


def test_several_tokens_in_one_step_match_one_token_steps() -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = one_per_step(params)
    core = engine()
    request = first_token(core, params)
    assert request.output_token_ids == want[:1]
    # a step that yields tokens 2-4 at once (a verified draft and its bonus token)
    deltas = core.role.accept_tokens(request, want[1:4], [None, None, None])
    assert [d.token_ids for d in deltas] == [want[1:4]]
    assert deltas[0].finish_reason is None
    # KV accounting: four tokens (the first and the three accepted) still lack K/V; the next
    # step computes them together, with the blocks they need, and samples token 5 from the last
    assert request.num_tokens - request.num_computed_tokens == 4
    blocks_before = len(core.kv_manager.block_table("r"))
    scheduled = core.scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in scheduled.scheduled] == [("r", 4)]
    assert core.kv_manager.blocks_to_allocate(request, 4) == 1  # tokens 22..25 cross into block 4
    core.resource_manager.prepare_resources([request])
    assert len(core.kv_manager.block_table("r")) == blocks_before + 1
    # hand the batch back to the engine's own step: the rest is ordinary decoding
    core.scheduler.running.remove(request)
    core.scheduler.waiting.appendleft(request)
    rest = drain(core)
    assert want[:4] + rest == want
    assert request.output_token_ids == want
    core.check_conservation()


@pytest.mark.parametrize("where", ["eos", "stop_token", "max_tokens"])
def test_the_first_finishing_token_ends_the_step(where: str) -> None:
    core = engine()
    eos = min(core.outputs.eos_token_ids)
    if where == "eos":
        params, cut = SamplingParams(max_tokens=10), eos
    elif where == "stop_token":
        params, cut = SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[77]), 77
    else:
        params, cut = SamplingParams(max_tokens=3, ignore_eos=True), 70
    request = first_token(core, params)
    first = request.output_token_ids[0]
    if first in (eos, 77):
        pytest.skip("the tiny model's first token already stops")
    step = [70, cut, 71, 72]  # the token after `cut` never counts
    deltas = core.role.accept_tokens(request, step, [None] * len(step))
    want = STOP_REASON[where]
    assert deltas[0].finish_reason == want
    assert deltas[0].token_ids == [70, cut]
    assert "r" not in core.requests  # finished and released in the same call
    core.check_conservation()


STOP_REASON = {
    "eos": FinishReason.STOP,
    "stop_token": FinishReason.STOP,
    "max_tokens": FinishReason.LENGTH,
}


def test_stop_string_across_the_step_tokens_cuts_the_text() -> None:
    core = engine()
    tokenizer = core.tokenizer
    stop = tokenizer.decode([72, 73])
    params = SamplingParams(max_tokens=10, ignore_eos=True, stop=[stop])
    request = first_token(core, params)
    before = tokenizer.decode(request.output_token_ids)
    if stop in before:
        pytest.skip("the tiny model's first token already holds the stop string")
    deltas = core.role.accept_tokens(request, [70, 72, 73, 74], [None] * 4)
    assert deltas[0].finish_reason == FinishReason.STOP
    assert deltas[0].token_ids == [70, 72, 73]
    assert stop not in deltas[0].text
    core.check_conservation()


def test_logprobs_come_one_per_accepted_token() -> None:
    core = engine()
    params = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=1)
    request = first_token(core, params)
    entries = [TokenLogprobs(t, -0.5 - i, [(t, -0.5 - i)]) for i, t in enumerate([70, 71, 72])]
    deltas = core.role.accept_tokens(request, [70, 71, 72], entries)
    # max_tokens 3: the first token and two of these; the third is dropped with its logprobs
    assert deltas[0].token_ids == [70, 71]
    assert deltas[0].logprobs == entries[:2]
    assert deltas[0].finish_reason == FinishReason.LENGTH
    core.check_conservation()


def test_the_itl_bound_counts_the_tokens_a_step_carries() -> None:
    """Measured: a step of 2 decode tokens takes 10 ms, one of 4 takes 80 ms (ITL target 50).
    A request whose next step carries 3 tokens makes the batch a 4-token step with one more
    request: too slow; the same request carrying one token makes a 2-token step: fine."""
    slo = SloPolicy(itl_slo_ms=50)
    for tokens, seconds in ((2, 0.01), (4, 0.08)):
        slo.steps.by_batch[tokens] = Ewma()
        slo.steps.by_batch[tokens].update(seconds)
    running = LlmRequest("a", PROMPT, SamplingParams(max_tokens=20))
    running.state = LlmRequestState.GENERATION_IN_PROGRESS
    running.output_token_ids = [70]
    running.num_computed_tokens = running.num_tokens - 1
    candidate = LlmRequest("b", PROMPT, SamplingParams(max_tokens=20))
    assert running.step_tokens == 1
    assert not slo.batch_too_slow([running], candidate)
    running.output_token_ids += [71, 72]  # a multi-token step left three tokens to compute
    assert running.step_tokens == 3
    assert slo.batch_too_slow([running], candidate)
