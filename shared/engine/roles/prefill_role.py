"""The prefill side of P/D: a request ends after its first token, its blocks pinned until the
push to the decode node completes; the node's layer hook sees every step's requests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.engine.commands import ContextPushed
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import FinishReason, LlmRequest, LlmRequestState
from shared.engine.roles.role import EngineParts, Handlers
from shared.engine.runtime.model_runner import LayerHook
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.engine.scheduling.scheduler import ScheduledRequest

S = LlmRequestState


@dataclass(frozen=True)
class KvAccess:
    """What a push needs from the KV manager on the engine thread: a request's blocks, and a
    pin that keeps the blocks being sent from eviction and reuse."""

    block_table: Callable[[str], list[int]]
    pin_blocks: Callable[[str, Sequence[int]], None]


# Called on the engine thread with a step's scheduled requests (before their counters advance);
# returns the hook the model calls after each layer's K/V are written, or None.
LayerHookFactory = Callable[[Sequence[ScheduledRequest], KvAccess], LayerHook | None]


@dataclass
class PrefillSettings:
    layer_hooks: LayerHookFactory | None = field(default=None, compare=False)
    context_only: bool = field(default=True, init=False)

    def build(self, parts: EngineParts) -> PrefillRole:
        return PrefillRole(parts, self.layer_hooks)


class PrefillRole:
    context_only = True

    def __init__(self, parts: EngineParts, layer_hooks: LayerHookFactory | None = None):
        self.parts = parts
        self.layer_hooks = layer_hooks
        kv = parts.kv_manager
        self._kv_access = KvAccess(kv.block_table, kv.pin_blocks)

    def handlers(self) -> Handlers:
        return {ContextPushed: lambda c: self.context_pushed(c.request_id, c.ok)}

    def after_step(self) -> None:
        pass

    def layer_hook(self, scheduled: Sequence[ScheduledRequest]) -> LayerHook | None:
        return None if self.layer_hooks is None else self.layer_hooks(scheduled, self._kv_access)

    def accept_token(
        self, request: LlmRequest, token: int, logprobs: TokenLogprobs | None
    ) -> list[TokenDelta]:
        """Last chunk computed: the seat goes back now; the blocks stay pinned until the push
        completes (`complete_context`), so nothing can evict or reuse them mid-send."""
        kv = self.parts.kv_manager
        request.output_token_ids.append(token)
        self.parts.scheduler.remove(request)
        kv.pin_blocks(request.request_id, kv.block_table(request.request_id))
        self.parts.requests.free_resources(request)
        request.transition(S.DISAGG_CONTEXT_TRANS_IN_PROGRESS)
        delta = TokenDelta(
            request.request_id,
            [token],
            "",
            None,
            logprobs=None if logprobs is None else [logprobs],
            prompt_logprobs=request.prompt_logprobs,
        )
        return [delta]

    def complete_context(self, request_id: str, ok: bool) -> None:
        """The push finished (ok) or failed: unpin; the blocks stay in the prefix cache."""
        table = self.parts.requests
        request = table.get(request_id)
        if request is None:
            return
        if request.state != S.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
            table.finish(request, FinishReason.ABORTED, S.DISAGG_TRANS_ERROR)
            return
        self.parts.kv_manager.unpin_request(request_id)
        request.transition(S.DISAGG_CONTEXT_COMPLETE if ok else S.DISAGG_TRANS_ERROR)
        table.retire(request)

    def context_pushed(self, request_id: str, ok: bool) -> None:
        """The prefill node is done with `request_id` (its push ended, ok or not, or it was
        cancelled or expired, maybe before its context was computed): release it either way.
        A push that did not complete ends DISAGG_TRANS_ERROR from any state."""
        self.parts.requests.abort_forks(request_id)
        self.complete_context(request_id, ok)
