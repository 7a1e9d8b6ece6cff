"""The engine's live requests, its n > 1 completion groups, and the one way a request ends.

Every end (finish, abort, failed transfer, a prefill node's context handed off) comes through
here, so the release order of docs/seat-system.md §7 (sampler state, then KV, then seat) and the
roles' own bookkeeping (`on_end`, e.g. the decode side's admission queue) are applied once.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from shared.engine.errors import RequestRejected
from shared.engine.requests.multimodal import PromptImage
from shared.engine.requests.output import OutputProcessor
from shared.engine.requests.request import (
    ALLOWED_TRANSITIONS,
    FinishReason,
    IllegalStateTransition,
    LlmRequest,
    LlmRequestState,
)
from shared.engine.requests.request_limits import RequestLimits
from shared.engine.resources.resource_manager import KVCacheManager
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.scheduling.scheduler import Scheduler

History = tuple[str, list[tuple[LlmRequestState, int | None]]]  # a request's states, their steps


def fork_id(parent_id: str, index: int) -> str:
    """Completion `index` (1..n-1) of request `parent_id`."""
    return f"{parent_id}#{index}"


class RequestTable:
    def __init__(
        self,
        limits: RequestLimits,
        scheduler: Scheduler,
        kv_manager: KVCacheManager,
        outputs: OutputProcessor,
        free_resources: Callable[[LlmRequest], None],
    ):
        self.limits = limits
        self.requests: dict[str, LlmRequest] = {}
        # n > 1: parent id -> its forks' ids, until every completion of the group has ended
        self.forks: dict[str, list[str]] = {}
        self.recent_history: deque[History] = deque(maxlen=1024)  # ended ones: tests, debugging
        self.outputs = outputs
        self.on_end: list[Callable[[str], None]] = []  # roles' bookkeeping of an ended request
        self._scheduler = scheduler
        self._kv = kv_manager
        self.free_resources = free_resources  # sampler row, then KV, then seat

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.requests

    def __iter__(self) -> Iterator[LlmRequest]:
        return iter(list(self.requests.values()))

    def get(self, request_id: str) -> LlmRequest | None:
        return self.requests.get(request_id)

    def live(self, request_id: str) -> LlmRequest:
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"request {request_id} is not live (aborted or finished)")
        return request

    # ---- start ----------------------------------------------------------------------------
    def new(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str = "",
        state: LlmRequestState = LlmRequestState.CONTEXT_INIT,
        images: Sequence[PromptImage] = (),
    ) -> LlmRequest:
        """A validated request, live from now on (RequestRejected naming the field)."""
        self.limits.check(prompt_token_ids, params)
        multimodal = self.limits.multimodal(prompt_token_ids, images)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests or fork_id(request_id, 1) in self.requests:
            raise RequestRejected(f"request_id {request_id!r} is already in flight")
        request = LlmRequest(
            request_id,
            list(prompt_token_ids),
            params.with_resolved_seed(),
            state=state,
            multimodal=multimodal,
            mrope_delta=0 if multimodal is None else multimodal.delta,
        )
        self.add(request)
        return request

    def add(self, request: LlmRequest) -> None:
        self.requests[request.request_id] = request
        self.outputs.add(request)

    def add_fork(self, child: LlmRequest) -> None:
        assert child.parent_id is not None
        self.add(child)
        self.forks.setdefault(child.parent_id, []).append(child.request_id)

    # ---- end ------------------------------------------------------------------------------
    def finish(
        self,
        request: LlmRequest,
        reason: FinishReason,
        state: LlmRequestState = LlmRequestState.GENERATION_COMPLETE,
    ) -> None:
        """End the request: out of the scheduler, its pins dropped, sampler row, blocks and seat
        back (in that order), its terminal state recorded."""
        self._scheduler.remove(request)
        self._kv.unpin_request(request.request_id)
        self.free_resources(request)
        request.finish_reason = reason
        if not request.is_finished:
            request.transition(_terminal_state(request, state))
        self.retire(request)

    def retire(self, request: LlmRequest) -> None:
        """Forget a request whose resources are already back (or handed on)."""
        request.finish_time = time.monotonic()
        rid = request.request_id
        self.requests.pop(rid, None)
        self.outputs.forget(rid)
        self.recent_history.append((rid, list(request.history)))
        for hook in self.on_end:
            hook(rid)
        group = request.group_id
        members = self.forks.get(group)
        if members is not None and not any(m in self.requests for m in (group, *members)):
            del self.forks[group]

    def abort_forks(self, request_id: str) -> None:
        """n > 1: end every completion forked from `request_id`."""
        for fork in list(self.forks.get(request_id, ())):
            if fork in self.requests:
                self.finish(self.requests[fork], FinishReason.ABORTED)

    def abort(
        self,
        request_id: str,
        state: LlmRequestState = LlmRequestState.GENERATION_COMPLETE,
    ) -> LlmRequest | None:
        """End the request and, for n > 1, every completion forked from it."""
        self.abort_forks(request_id)
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, FinishReason.ABORTED, state)
        return request

    def check_empty(self) -> None:
        assert not self.requests, f"requests still live: {sorted(self.requests)[:10]}"
        assert not self.forks, f"completion groups still tracked: {sorted(self.forks)[:10]}"


def _terminal_state(request: LlmRequest, wanted: LlmRequestState) -> LlmRequestState:
    """`wanted` where the transition table allows it from here, else where an abort ends."""
    allowed = ALLOWED_TRANSITIONS[request.state]
    for state in (wanted, LlmRequestState.GENERATION_COMPLETE, LlmRequestState.DISAGG_TRANS_ERROR):
        if state in allowed:
            return state
    raise IllegalStateTransition(f"request {request.request_id} cannot end from {request.state}")
