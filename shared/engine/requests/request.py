"""LlmRequest and its state machine.

States follow TensorRT-LLM's LlmRequestState (docs/seat-system.md §8). Every change goes through
`LlmRequest.transition`, which checks `ALLOWED_TRANSITIONS`; an illegal move raises, because a
request in the wrong state is how seats and blocks leak.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:  # request bookkeeping imports no torch
    from shared.engine.requests.multimodal import MultimodalPrompt
    from shared.engine.sampling.logprobs import TokenLogprobs


class LlmRequestState(enum.Enum):
    # waiting for admission (fresh, or preempted for recompute): holds no seat and no block
    QUEUED = "queued"
    CONTEXT_INIT = "context_init"  # admitted: prefilling (blocks grow with each chunk)
    GENERATION_IN_PROGRESS = "generation_in_progress"
    GENERATION_COMPLETE = "generation_complete"
    # decode side of P/D
    DISAGG_GENERATION_INIT = "disagg_generation_init"  # blocks reserved, no seat
    DISAGG_GENERATION_TRANS_IN_PROGRESS = "disagg_generation_trans_in_progress"
    DISAGG_GENERATION_TRANS_COMPLETE = "disagg_generation_trans_complete"  # seat at next prepare
    # prefill side of P/D
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = (
        "disagg_context_trans_in_progress"  # seat gone, blocks pinned
    )
    DISAGG_CONTEXT_COMPLETE = "disagg_context_complete"
    DISAGG_TRANS_ERROR = "disagg_trans_error"


S = LlmRequestState

ALLOWED_TRANSITIONS: dict[LlmRequestState, frozenset[LlmRequestState]] = {
    # admitted locally (CONTEXT_INIT) or for a KV transfer (DISAGG_GENERATION_INIT); the two
    # terminal moves are a cancel, an expired deadline or a drain: nothing to free
    S.QUEUED: frozenset(
        {S.CONTEXT_INIT, S.DISAGG_GENERATION_INIT, S.GENERATION_COMPLETE, S.DISAGG_TRANS_ERROR}
    ),
    S.CONTEXT_INIT: frozenset(
        {
            S.QUEUED,  # preempted mid-prefill
            S.GENERATION_IN_PROGRESS,
            S.GENERATION_COMPLETE,
            S.DISAGG_CONTEXT_TRANS_IN_PROGRESS,
            S.DISAGG_TRANS_ERROR,
        }
    ),
    S.GENERATION_IN_PROGRESS: frozenset({S.GENERATION_COMPLETE, S.QUEUED}),
    S.GENERATION_COMPLETE: frozenset(),
    S.DISAGG_GENERATION_INIT: frozenset(
        {S.DISAGG_GENERATION_TRANS_IN_PROGRESS, S.DISAGG_TRANS_ERROR, S.GENERATION_COMPLETE}
    ),
    S.DISAGG_GENERATION_TRANS_IN_PROGRESS: frozenset(
        {S.DISAGG_GENERATION_TRANS_COMPLETE, S.DISAGG_TRANS_ERROR, S.GENERATION_COMPLETE}
    ),
    S.DISAGG_GENERATION_TRANS_COMPLETE: frozenset(
        {S.GENERATION_IN_PROGRESS, S.GENERATION_COMPLETE, S.QUEUED}
    ),
    S.DISAGG_CONTEXT_TRANS_IN_PROGRESS: frozenset(
        {S.DISAGG_CONTEXT_COMPLETE, S.DISAGG_TRANS_ERROR}
    ),
    S.DISAGG_CONTEXT_COMPLETE: frozenset(),
    S.DISAGG_TRANS_ERROR: frozenset(),
}

TERMINAL_STATES = frozenset(s for s, nxt in ALLOWED_TRANSITIONS.items() if not nxt)


class IllegalStateTransition(RuntimeError):
    pass


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORTED = "aborted"


@dataclass(eq=False)  # identity: requests are entities, compared by `is`
class LlmRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    state: LlmRequestState = LlmRequestState.CONTEXT_INIT
    seq_slot: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # tokens whose K/V are in this node's pool (prefix-cache hits included)
    num_computed_tokens: int = 0
    cached_tokens: int = 0  # prefix-cache hit of the first admission, reported in usage
    finish_reason: FinishReason | None = None
    stop_reason_text: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    return_perf_metrics: bool = True
    # prompt_logprobs requested: entry i is position i's (None for the first token, and for
    # positions not yet computed)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # n > 1: completion 0 is the request itself; completions 1.. are forks of it
    parent_id: str | None = None
    choice_index: int = 0
    # first tokens of completions 1..n-1, drawn from this request's last prompt logits
    choice_first_tokens: list[tuple[int, TokenLogprobs | None]] = field(default_factory=list)
    # chained hashes of the prompt's leading full blocks, once known: from its creator (the
    # decode node hashes a prompt once, on its event loop, for routing and the local-prefill
    # check) or from the first prefix match; the prefix cache extends from them instead of
    # hashing the prompt again
    prompt_block_hashes: list[bytes] = field(default_factory=list)
    # its blocks that some layers' KV never reached (window-aware transfer: shared/engine/
    # kv_window.py), set before the transfer; the prefix cache never publishes them
    partial_blocks: tuple[int, ...] = ()
    # its prompt's KV is pushed by a prefill node (the decode side's KV connector reads this,
    # as vLLM's P/D connectors read a request's transfer parameters)
    remote_prefill: bool = False
    # tokens a speculative proposer drafted after its last token, verified by the next step
    # (shared/engine/speculative/drafter.py); not output until accepted
    draft_token_ids: list[int] = field(default_factory=list)
    # its prompt's images (Qwen2-VL); None for a text prompt
    multimodal: MultimodalPrompt | None = None
    # mRoPE: position minus index of its tokens after the prompt, from its images or (decode
    # node) its KV header; written into the seat's delta row when it takes a seat
    mrope_delta: int = 0
    # (state entered, seat held at that moment): the debug trail tests read the lifecycle from
    history: list[tuple[LlmRequestState, int | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history.append((self.state, self.seq_slot))
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def group_id(self) -> str:
        """The id the client knows: a fork reports under its parent's."""
        return self.parent_id or self.request_id

    @property
    def forks_pending(self) -> bool:
        """n > 1 and the other completions are not forked yet (no first token drawn)."""
        return self.sampling_params.n > 1 and self.parent_id is None and not self.output_token_ids

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (the first has none)."""
        lps = self.prompt_logprobs
        return lps is not None and any(lp is None for lp in lps[1:])

    def transition(self, new_state: LlmRequestState) -> None:
        if new_state not in ALLOWED_TRANSITIONS[self.state]:
            raise IllegalStateTransition(
                f"request {self.request_id}: illegal transition {self.state.name} -> "
                f"{new_state.name}"
            )
        self.state = new_state
        self.history.append((new_state, self.seq_slot))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def step_tokens(self) -> int:
        """Tokens the next step carries for this request once it is generating: one, or the
        several a multi-token step left uncomputed (accepted speculative tokens)."""
        if self.state != LlmRequestState.GENERATION_IN_PROGRESS:
            return 1
        return max(1, self.num_tokens - self.num_computed_tokens)

    def hash_token_ids(self, num_tokens: int) -> list[int]:
        """Its first `num_tokens` tokens as the prefix cache hashes them: an image's
        placeholders stand for its digest (shared/engine/requests/multimodal.py)."""
        tokens = self.all_token_ids[:num_tokens]
        return tokens if self.multimodal is None else self.multimodal.hash_token_ids(tokens)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def is_disagg_waiting_for_kv(self) -> bool:
        return self.state in (
            LlmRequestState.DISAGG_GENERATION_INIT,
            LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS,
        )

    def max_total_tokens(self) -> int:
        """Tokens the request may ever hold in the KV cache (the last sampled one is never fed)."""
        return self.prompt_len + self.sampling_params.max_tokens - 1
