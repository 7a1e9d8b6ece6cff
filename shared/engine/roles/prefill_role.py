"""The prefill side of P/D: a request ends after its first token; its blocks stay held by the KV
connector (shared/engine/connector/kv_push.py) until the push to the decode node completes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.engine.commands import ContextPushed
from shared.engine.connector.base import KvConnector
from shared.engine.connector.kv_push import KvPushConnector, LayerHookFactory
from shared.engine.connector.multi import MultiConnector
from shared.engine.connector.offload import OffloadConnector, OffloadStats
from shared.engine.connector.offload_config import OffloadConfig
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import FinishReason, LlmRequest, LlmRequestState
from shared.engine.resources.resource_manager import KVCacheManager
from shared.engine.roles.role import Emit, EngineParts, Handlers
from shared.engine.sampling.logprobs import TokenLogprobs

S = LlmRequestState


@dataclass
class PrefillSettings:
    layer_hooks: LayerHookFactory | None = field(default=None, compare=False)
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # KV tiers below the pool
    # what the tiers count, for the node's /metrics
    offload_stats: OffloadStats = field(default_factory=OffloadStats, compare=False)
    context_only: bool = field(default=True, init=False)

    def connector(self, kv: KVCacheManager) -> KvConnector:
        """The push, and the tiers: a prompt whose prefix the pool evicted loads it back."""
        push = KvPushConnector(kv, self.layer_hooks)
        if not self.offload.enabled:
            return push
        return MultiConnector([push, OffloadConnector(kv, self.offload, self.offload_stats)])

    def hold(self) -> None:
        return None  # no decode batch to protect

    def drafting(self) -> PrefillSettings:
        raise ValueError("a prefill node decodes nothing: it has no draft model to run")

    def build(self, parts: EngineParts) -> PrefillRole:
        return PrefillRole(parts)


class PrefillRole:
    context_only = True

    def __init__(self, parts: EngineParts):
        self.parts = parts

    def handlers(self) -> Handlers:
        return {ContextPushed: lambda c: self.context_pushed(c.request_id, c.ok)}

    def bind(self, emit: Emit) -> None:
        pass  # a prefill node's answers are the deltas alone

    def after_step(self) -> None:
        pass

    def accept_tokens(
        self,
        request: LlmRequest,
        tokens: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None],
    ) -> list[TokenDelta]:
        """Last chunk computed: the first token is the request's whole output (later tokens of a
        step are the decode node's to make); the seat goes back now and the blocks stay held by
        the connector until the push completes, so nothing can evict or reuse them mid-send."""
        token, first_logprobs = tokens[0], logprobs[0]
        request.output_token_ids.append(token)
        self.parts.scheduler.remove(request)
        # the node releases the request (ContextPushed) once its push is over, whether or not
        # the connector holds blocks for it meanwhile
        self.parts.connector.request_finished(request)
        self.parts.requests.free_resources(request)
        request.transition(S.DISAGG_CONTEXT_TRANS_IN_PROGRESS)
        delta = TokenDelta(
            request.request_id,
            [token],
            "",
            None,
            logprobs=None if first_logprobs is None else [first_logprobs],
            prompt_logprobs=request.prompt_logprobs,
        )
        return [delta]

    def end_with_error(
        self, request: LlmRequest, token: int, logprobs: TokenLogprobs | None, reason: str
    ) -> list[TokenDelta]:
        """The prompt's KV is sound whatever the grammar says: its push completes as any other
        and its blocks are released the usual way; the node answers the error (prefill_node)."""
        deltas = self.accept_tokens(request, [token], [logprobs])
        for delta in deltas:
            delta.error = reason
        return deltas

    def complete_context(self, request_id: str, ok: bool) -> None:
        """The push finished (ok) or failed: the connector lets the blocks go; they stay in the
        prefix cache."""
        table = self.parts.requests
        request = table.get(request_id)
        if request is None:
            return
        if request.state != S.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
            table.finish(request, FinishReason.ABORTED, S.DISAGG_TRANS_ERROR)
            return
        self.parts.connector.release(request_id)
        request.transition(S.DISAGG_CONTEXT_COMPLETE if ok else S.DISAGG_TRANS_ERROR)
        table.retire(request)

    def context_pushed(self, request_id: str, ok: bool) -> None:
        """The prefill node is done with `request_id` (its push ended, ok or not, or it was
        cancelled or expired, maybe before its context was computed): release it either way.
        A push that did not complete ends DISAGG_TRANS_ERROR from any state."""
        self.parts.requests.abort_forks(request_id)
        self.complete_context(request_id, ok)
