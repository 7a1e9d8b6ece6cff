"""The decode side of P/D, mixed into `EngineCore`: a request is admitted with blocks reserved
and pinned for the KV the prefill node pushes, and becomes schedulable once it has landed."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared.engine.block_manager import NoFreeBlocksError
from shared.engine.errors import ResourcesExhausted
from shared.engine.fork import fork_completions
from shared.engine.logprobs import TokenLogprobs
from shared.engine.output import TokenDelta
from shared.engine.request import FinishReason, LlmRequest, LlmRequestState
from shared.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shared.engine.core import EngineCore


class TransferRole:
    """Methods of `EngineCore` that only a decode node calls."""

    def reserve_for_transfer(
        self: EngineCore,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str = "",
    ) -> tuple[LlmRequest, list[int], int]:
        """Admit a request in DISAGG_GENERATION_INIT: blocks reserved (minus this node's own
        prefix-cache hit) and pinned for the incoming transfer, no seat. Returns the request,
        the blocks to fill and the prompt block index of the first of them."""
        request = self.new_request(
            prompt_token_ids, params, request_id, LlmRequestState.DISAGG_GENERATION_INIT
        )
        try:
            # the prefill node computes the prompt (and its logprobs): any hit here is usable
            cached = self.kv_manager.acquire_prefix(request, request.prompt_len - 1)
            request.cached_tokens = cached
            new_blocks = self.kv_manager.reserve(request, request.prompt_len)
        except NoFreeBlocksError:
            self.finish_request(request, FinishReason.ABORTED, LlmRequestState.DISAGG_TRANS_ERROR)
            raise ResourcesExhausted(
                f"no KV blocks free for a {request.prompt_len}-token prompt; retry later"
            ) from None
        self.kv_manager.pin_blocks(request.request_id, new_blocks)
        return request, new_blocks, cached // self.config.block_size

    def start_transfer(self: EngineCore, request_id: str) -> None:
        self._live(request_id).transition(LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS)

    def complete_transfer(
        self: EngineCore,
        request_id: str,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
    ) -> TokenDelta:
        deltas = self.complete_transfer_all(
            request_id, first_token, first_logprobs, prompt_logprobs
        )
        return deltas[0]

    def complete_transfer_all(
        self: EngineCore,
        request_id: str,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
        choices: Sequence[tuple[int, TokenLogprobs | None]] = (),
    ) -> list[TokenDelta]:
        """All KV landed: the request becomes schedulable (its seat comes at the next prepare);
        the first token, sampled on the prefill node, is processed at once, with the logprobs
        the prefill node computed for it and for the prompt. n > 1: `choices` are the other
        completions' first tokens; they are forked off the landed KV here (deltas after the
        request's own)."""
        request = self._live(request_id)
        if prompt_logprobs is not None:
            request.prompt_logprobs = prompt_logprobs
        # transition first: an illegal call must not drop the pins of a transfer in flight
        request.transition(LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE)
        self.kv_manager.unpin_request(request_id)
        request.num_computed_tokens = request.prompt_len
        self.kv_manager.cache_computed_blocks(request)
        request.first_token_time = time.monotonic()
        request.choice_first_tokens = list(choices)
        forks = fork_completions(self, request) if choices else []
        delta = self.outputs.process(request, first_token, first_logprobs)
        if delta.finish_reason is not None:
            self.finish_request(request, delta.finish_reason)
        else:
            self.scheduler.add_request(request)
        return [delta, *forks]

    def fail_transfer(self: EngineCore, request_id: str) -> None:
        self.abort_forks(request_id)
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, FinishReason.ABORTED, LlmRequestState.DISAGG_TRANS_ERROR)

    def _live(self: EngineCore, request_id: str) -> LlmRequest:
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"request {request_id} is not live (aborted or finished)")
        return request
