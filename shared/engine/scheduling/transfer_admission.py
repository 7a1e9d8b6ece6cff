"""Decode-side admission: a `Generate` request waits QUEUED (no seat, no block) until the blocks
for its prompt and first generated token are free, then gets them reserved and pinned for the
incoming KV transfer (DISAGG_GENERATION_INIT -> TRANS_IN_PROGRESS).

Runs on the engine thread, driven by the decode role after every step and command (the only
moments blocks can free up). Admission is in `AdmissionQueue`'s order (priority, aged; FIFO
when every priority is 0), and leaves free the
blocks that requests the scheduler itself holds QUEUED wait for (preempted for recompute, or a
local prefill not yet scheduled): they came first, and letting new transfers take those blocks
would starve them; refusing while they wait would refuse work the pool can hold. With TTFT or
ITL targets (shared/engine/scheduling/slo.py) a request that would miss its TTFT target is refused
at once,
before anything is allocated, and the head is held while admitting it would make the decode batch
too slow for the tightest ITL target in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared.cdiv import cdiv
from shared.engine.connector.base import KvConnector
from shared.engine.errors import ResourcesExhausted
from shared.engine.requests.multimodal import PromptImage
from shared.engine.requests.request import FinishReason, LlmRequest, LlmRequestState
from shared.engine.resources.block_manager import BlockHash
from shared.engine.resources.resource_manager import KVCacheManager
from shared.engine.roles.role import EngineParts
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.scheduling.admission_queue import AdmissionQueue, QueueEntry, QueueFull
from shared.engine.scheduling.slo import SloPolicy, step_tokens, tokens_still_to_prefill

S = LlmRequestState
DEFAULT_MAX_QUEUED = 1024


class AdmissionClosed(RuntimeError):
    """The node is draining (shutting down): nothing new is queued (mapped to UNAVAILABLE)."""


@dataclass
class TransferGrant:
    """What an admitted request needs for its transfer: the blocks the prefill node fills and the
    prompt block index of the first of them (the ones before it are this node's prefix hit)."""

    request: LlmRequest
    blocks: list[int]
    first_block: int
    queue_seconds: float


# (request_id, grant) on admission, (request_id, None) when its deadline passed in the queue
AdmissionCallback = Callable[[str, TransferGrant | None], None]


class TransferAdmission:
    def __init__(
        self,
        parts: EngineParts,
        max_queued: int = DEFAULT_MAX_QUEUED,
        max_admitted: int | None = None,
    ):
        self.parts = parts
        self.queue: AdmissionQueue[LlmRequest] = AdmissionQueue(max_queued)
        self.max_admitted = max_admitted  # requests past the queue at once (--max-inflight)
        self.on_admission: AdmissionCallback | None = None
        self._grants: dict[str, TransferGrant] = {}  # admitted this round, not yet reported
        self.closed = False  # set by drain: a request racing the shutdown is not queued
        self.slo = SloPolicy()

    def configure(
        self, max_queued: int, max_admitted: int | None, slo: SloPolicy | None = None
    ) -> None:
        self.queue.max_queued = max_queued
        self.max_admitted = max_admitted
        if slo is not None:
            self.slo = slo

    def __len__(self) -> int:
        return len(self.queue)

    def enqueue(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        deadline: float | None = None,
        prompt_hashes: Sequence[BlockHash] = (),
        images: Sequence[PromptImage] = (),
    ) -> LlmRequest:
        """Validate, create the request QUEUED and queue it (then try to admit at once). Its
        images stay with it: a preempted request computes its prompt here.
        Raises RequestRejected (bad input, or a request the pool could never hold) or
        ResourcesExhausted (queue full, or its TTFT target out of reach: `retry_after_s`)."""
        if self.closed:
            raise AdmissionClosed("node is shutting down: retry on another node")
        table = self.parts.requests
        table.limits.check(prompt_token_ids, params)
        now = time.monotonic()
        self.predict_ttft(request_id, len(prompt_token_ids), params, now)
        request = table.new(prompt_token_ids, params, request_id, S.QUEUED, images)
        request.prompt_block_hashes = list(prompt_hashes)  # the prefix match hashes nothing
        request.remote_prefill = True  # a prefill node computes it: the connector loads it
        entry = QueueEntry(request_id, request, now, deadline)
        if not self.queue and self._admit_now(entry):
            return request  # it fits now: it never counts against the queue's bound
        try:
            priority = params.service.priority
            self.queue.push(request.request_id, request, now, deadline, priority)
        except QueueFull as e:
            table.finish(request, FinishReason.ABORTED)
            raise ResourcesExhausted(str(e), e.retry_after_s) from None
        self.admit()
        return request

    def predict_ttft(
        self, rid: str, tokens: int, params: SamplingParams, now: float
    ) -> float | None:
        """The TTFT this request would see if queued now (slo.py); raises SloMiss (a
        ResourcesExhausted) when that misses its target. Allocates nothing."""
        order = self.queue.order_key(now, params.service.priority)
        before = [e.item.prompt_len for e in self.queue.entries() if e.order < order]
        queued = set(self.queue.keys())
        live = (r for r in self.parts.requests if r.request_id not in queued)
        ahead = sum(before) + tokens_still_to_prefill(live)
        # when blocks, not prefill, bound the drain: those ahead at the queue's admission rate
        rate = self.queue.admission_rate(now)
        wait = len(before) / rate if before and rate else 0.0
        return self.slo.check_ttft(rid, tokens, ahead, params.service, wait, now)

    def forget(self, request_id: str) -> None:
        """The request ended (a cancel, or it finished): it leaves the queue; it held
        nothing there."""
        self.queue.remove(request_id)
        self.slo.forget(request_id)

    def drain(self) -> list[str]:
        """Shutting down: end every queued request (ABORTED) and queue no more; returns their
        ids."""
        self.closed = True
        ids = self.queue.keys()
        for rid in ids:
            request = self.parts.requests.get(rid)
            if request is not None:
                self.parts.requests.finish(request, FinishReason.ABORTED)
        return ids

    def admit(self) -> None:
        now = time.monotonic()
        parts = self.parts
        self.slo.steps.tick(parts.num_steps, step_tokens(parts.scheduler.running), now)
        if not self.queue:
            return
        for entry in self.queue.pop_expired(now):
            parts.requests.finish(entry.item, FinishReason.ABORTED)
            if self.on_admission is not None:
                self.on_admission(entry.key, None)
        for entry in self.queue.admit(lambda e: self._try_admit(e, now), now):
            grant = self._grants.pop(entry.key)
            if self.on_admission is not None:
                self.on_admission(entry.key, grant)

    def _admit_now(self, entry: QueueEntry[LlmRequest]) -> bool:
        if not self._try_admit(entry, entry.enqueued_at, queued=False):
            return False
        grant = self._grants.pop(entry.key)
        if self.on_admission is not None:
            self.on_admission(entry.key, grant)
        return True

    def _try_admit(self, entry: QueueEntry[LlmRequest], now: float, queued: bool = True) -> bool:
        parts = self.parts
        if self.max_admitted is not None:
            # every live request not waiting here (the candidate itself excluded)
            admitted = len(parts.requests) - len(self.queue) - (0 if queued else 1)
            if admitted >= self.max_admitted:
                return False
        request = entry.item
        if self.slo.batch_too_slow(self._past_queue(request), request):
            return False
        grant = reserve_transfer_blocks(
            parts.kv_manager, parts.connector, request, parts.scheduler.queued_block_need()
        )
        if grant is None:
            return False
        grant.queue_seconds = now - entry.enqueued_at
        self.slo.rate.started(entry.key, request.prompt_len - request.cached_tokens, now)
        self._grants[entry.key] = grant
        return True

    def _past_queue(self, candidate: LlmRequest) -> list[LlmRequest]:
        """The live requests past admission (the decode batch, and those about to join it)."""
        return [
            r for r in self.parts.requests if r is not candidate and r.request_id not in self.queue
        ]


def reserve_transfer_blocks(
    kv: KVCacheManager, connector: KvConnector, request: LlmRequest, owed: int = 0
) -> TransferGrant | None:
    """QUEUED -> DISAGG_GENERATION_INIT -> TRANS_IN_PROGRESS when the prompt's blocks (minus
    this node's prefix hit) and room for the first decoded token are free beside the `owed`
    blocks the scheduler's own QUEUED requests wait for: the blocks for what the connector
    supplies are reserved and handed to it; otherwise nothing is taken and None is returned.
    The one reservation path for a transfer."""
    cached = kv.acquire_prefix(request)
    held = len(kv.block_table(request.request_id))
    # the first decoded token's slot only where one comes (max_tokens 1 ends at the transfer)
    need = cdiv(min(request.prompt_len + 1, request.max_total_tokens()), kv.block_size) - held
    if need + owed > kv.num_free_blocks:
        kv.free_resources(request)  # the prefix goes back; it is matched again next time
        return None
    request.cached_tokens = cached
    request.transition(S.DISAGG_GENERATION_INIT)
    new_blocks = kv.reserve(request, cached + connector.external_tokens(request, cached))
    connector.after_allocate(request, new_blocks)
    request.transition(S.DISAGG_GENERATION_TRANS_IN_PROGRESS)
    return TransferGrant(request, new_blocks, cached // kv.block_size, 0.0)
