"""The prefill side of P/D, mixed into `EngineCore` (built with `context_only=True`): a request
ends after its first token, its blocks pinned until the push to the decode node completes."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from shared.engine.logprobs import TokenLogprobs
from shared.engine.output import TokenDelta
from shared.engine.request import FinishReason, LlmRequest, LlmRequestState

if TYPE_CHECKING:
    from shared.engine.core import EngineCore


class ContextRole:
    """Methods of `EngineCore` that only a prefill node calls."""

    def _finish_context(
        self: EngineCore, request: LlmRequest, token: int, logprobs: TokenLogprobs | None
    ) -> TokenDelta:
        """Last chunk computed: the seat goes back now; the blocks stay pinned until the push
        completes (`complete_context`), so nothing can evict or reuse them mid-send."""
        request.output_token_ids.append(token)
        self.scheduler.remove(request)
        self.kv_manager.pin_blocks(
            request.request_id, self.kv_manager.block_table(request.request_id)
        )
        self.free_request_resources(request)
        request.transition(LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS)
        return TokenDelta(
            request.request_id,
            [token],
            "",
            None,
            logprobs=None if logprobs is None else [logprobs],
            prompt_logprobs=request.prompt_logprobs,
        )

    def complete_context(self: EngineCore, request_id: str, ok: bool) -> None:
        """The push finished (ok) or failed: unpin; the blocks stay in the prefix cache."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.state != LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
            self.finish_request(request, FinishReason.ABORTED, LlmRequestState.DISAGG_TRANS_ERROR)
            return
        self.kv_manager.unpin_request(request_id)
        request.transition(
            LlmRequestState.DISAGG_CONTEXT_COMPLETE if ok else LlmRequestState.DISAGG_TRANS_ERROR
        )
        request.finish_time = time.monotonic()
        self.requests.pop(request_id, None)
        self.outputs.forget(request_id)
        self.recent_history.append((request_id, list(request.history)))

    def context_pushed(self: EngineCore, request_id: str, ok: bool) -> None:
        """The prefill node is done with `request_id` (its push ended, ok or not, or it was
        cancelled or expired, maybe before its context was computed): release it either way.
        A push that did not complete ends DISAGG_TRANS_ERROR from any state."""
        self.abort_forks(request_id)
        self.complete_context(request_id, ok)
