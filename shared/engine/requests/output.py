"""Turns sampled tokens into finish decisions and streamed text (EOS, max_tokens, stop strings).

Text that could still grow into a stop string is held back until it cannot, so a client never
receives characters that a later stop match would have cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.engine.requests.request import FinishReason, LlmRequest
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TokenDelta:
    """What one request produced in one step: new tokens, their released text, and whether it
    finished."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    # one per token in token_ids when the request asked for logprobs (raw distribution)
    logprobs: list[TokenLogprobs] | None = None
    # on the delta of the first token only, when asked: one per prompt position (None first)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    index: int = 0  # which of the request's n completions (request_id is the client's id)
    # set when the request failed (its grammar could not go on): the client's error message
    error: str | None = None


@dataclass
class OutputState:
    detokenizer: IncrementalDetokenizer
    stops: tuple[str, ...]
    include_stop: bool = False  # a matched stop string stays in the text (vLLM's option)
    text: str = ""  # all text decoded so far (stop string included until finish)
    emitted: int = 0  # chars of `text` already released to the client
    checked: int = 0  # chars of `text` already searched for stop strings
    pending_tokens: list[int] = field(default_factory=list)

    @property
    def holdback(self) -> int:
        return max((len(s) for s in self.stops), default=1) - 1


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._states: dict[str, OutputState] = {}

    def add(self, request: LlmRequest) -> None:
        params = request.sampling_params
        prompt = request.prompt_token_ids
        done = min(params.continued_tokens, len(prompt))
        split = len(prompt) - done
        state = OutputState(
            IncrementalDetokenizer(self.tokenizer, prompt[:split]),
            params.stop,
            params.include_stop_str_in_output,
        )
        if done:
            # the answer's first tokens were streamed by an earlier call, which decoded them one
            # at a time from the same context and released all but its holdback: start where it
            # stopped, so that what it held back (a partial character, a possible stop string)
            # comes now, and nothing it sent comes twice
            for token in prompt[split:]:
                state.text += state.detokenizer.push([token])
            state.emitted = max(0, len(state.text) - state.holdback)
            state.checked = len(state.text)
        self._states[request.request_id] = state

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def process(
        self, request: LlmRequest, token: int, logprobs: TokenLogprobs | None = None
    ) -> TokenDelta:
        """Record `token` as the request's next output and decide whether it finishes."""
        return self.process_tokens(request, [token], [logprobs])

    def process_tokens(
        self,
        request: LlmRequest,
        tokens: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None],
    ) -> TokenDelta:
        """Record a step's `tokens` (in order, one logprobs entry each) as the request's next
        outputs, in one delta. The first token that finishes the request ends it: the tokens
        after it are dropped, as one-token steps would never have produced them."""
        state = self._states[request.request_id]
        reason: FinishReason | None = None
        kept: list[TokenLogprobs] = []
        for token, token_logprobs in zip(tokens, logprobs, strict=True):
            reason = self._record(request, state, token)
            if token_logprobs is not None:
                kept.append(token_logprobs)
            if reason is not None:
                break
        if reason is not None and not (state.stops and reason == FinishReason.STOP):
            state.text += state.detokenizer.flush()
        if reason:
            release_to = len(state.text)
        else:
            release_to = max(state.emitted, len(state.text) - state.holdback)
        delta = TokenDelta(
            request.group_id,
            state.pending_tokens,
            state.text[state.emitted : release_to],
            reason,
            index=request.choice_index,
        )
        if kept:
            delta.logprobs = kept
        if len(request.output_token_ids) == len(state.pending_tokens):  # its first output
            delta.prompt_logprobs = request.prompt_logprobs
        state.emitted = release_to
        state.pending_tokens = []
        return delta

    def _record(self, request: LlmRequest, state: OutputState, token: int) -> FinishReason | None:
        """Append one token to the request's output and text; why it finishes there, if it
        does."""
        request.output_token_ids.append(token)
        state.pending_tokens.append(token)
        state.text += state.detokenizer.push([token])
        params = request.sampling_params
        # min_tokens: no stop of any kind before then (the sampler already masks EOS/stop ids)
        may_stop = len(request.output_token_ids) >= params.min_tokens
        if may_stop and (
            (state.stops and self._cut_at_stop(state))
            or (token in self.eos_token_ids and not params.ignore_eos)
            or token in params.stop_token_ids
        ):
            return FinishReason.STOP
        if not may_stop:
            state.checked = len(state.text)  # a stop string seen before min_tokens does not count
        if len(request.output_token_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _cut_at_stop(state: OutputState) -> bool:
        # a new match must end in the new text, so it starts at most `holdback` chars earlier
        start = max(0, state.checked - state.holdback)
        state.checked = len(state.text)
        best, end = -1, -1
        for stop in state.stops:
            pos = state.text.find(stop, start)
            if pos != -1 and (best == -1 or pos < best):
                best, end = pos, pos + len(stop)
        if best == -1:
            return False
        state.text = state.text[: end if state.include_stop else best]
        return True


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    cached_tokens: int
    num_preemptions: int
    logprobs: list[TokenLogprobs] | None = None  # per output token, when asked
    index: int = 0  # which of the prompt's n completions
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token, when asked
    error: str | None = None  # why it ended early (finish_reason ABORTED): its grammar failed
