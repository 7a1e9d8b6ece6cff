from __future__ import annotations

import pytest

from shared.engine.requests.request import (
    ALLOWED_TRANSITIONS,
    TERMINAL_STATES,
    IllegalStateTransition,
    LlmRequest,
    LlmRequestState,
)
from shared.engine.sampling.sampling_params import SamplingParams

S = LlmRequestState


def make(state: LlmRequestState) -> LlmRequest:
    return LlmRequest("r", [1], SamplingParams(), state=state)


def test_every_state_has_a_row() -> None:
    assert set(ALLOWED_TRANSITIONS) == set(LlmRequestState)
    assert {
        S.GENERATION_COMPLETE,
        S.DISAGG_CONTEXT_COMPLETE,
        S.DISAGG_TRANS_ERROR,
    } == TERMINAL_STATES


def test_decode_side_disagg_path() -> None:
    r = make(S.DISAGG_GENERATION_INIT)
    for nxt in (
        S.DISAGG_GENERATION_TRANS_IN_PROGRESS,
        S.DISAGG_GENERATION_TRANS_COMPLETE,
        S.GENERATION_IN_PROGRESS,
        S.GENERATION_COMPLETE,
    ):
        r.transition(nxt)
    assert r.history[0] == (S.DISAGG_GENERATION_INIT, None) and r.is_finished


def test_prefill_side_path_and_errors() -> None:
    r = make(S.CONTEXT_INIT)
    r.transition(S.DISAGG_CONTEXT_TRANS_IN_PROGRESS)
    r.transition(S.DISAGG_CONTEXT_COMPLETE)
    bad = make(S.DISAGG_GENERATION_TRANS_IN_PROGRESS)
    bad.transition(S.DISAGG_TRANS_ERROR)
    with pytest.raises(IllegalStateTransition):
        bad.transition(S.GENERATION_IN_PROGRESS)


@pytest.mark.parametrize(
    ("start", "target"),
    [
        (S.DISAGG_GENERATION_INIT, S.GENERATION_IN_PROGRESS),  # no decoding before KV arrived
        (S.DISAGG_GENERATION_INIT, S.DISAGG_GENERATION_TRANS_COMPLETE),
        (S.GENERATION_COMPLETE, S.CONTEXT_INIT),
        (S.CONTEXT_INIT, S.DISAGG_GENERATION_INIT),
        (S.DISAGG_CONTEXT_TRANS_IN_PROGRESS, S.GENERATION_IN_PROGRESS),
    ],
)
def test_illegal_transitions_raise(start: LlmRequestState, target: LlmRequestState) -> None:
    r = make(start)
    with pytest.raises(IllegalStateTransition, match=target.name):
        r.transition(target)
    assert r.state == start
