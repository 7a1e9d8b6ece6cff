"""Iteration-level continuous batching with chunked prefill (no torch, no I/O).

Each step: running requests first, oldest first (decodes take one token, unfinished prefills take
the next chunk), then waiting requests (those holding blocks first, then FCFS) while a seat, batch
room, token budget and blocks remain; a role's `hold` (a decode role's ITL bound) may keep new
prompts out of a non-empty batch. A fresh request's prompt tokens that a KV connector supplies
(shared/engine/connector/) are reserved with its prefix hit and loaded before the step's forward,
never computed. Waiting requests are QUEUED ones (holding nothing: fresh, or
preempted) and, on a decode node, requests whose KV arrived (holding their prompt's blocks).
Reservation is incremental: a QUEUED request is admitted when the blocks for its context plus its
first new token (`admit_lookahead`) are free, and grows block by block as it decodes. When running
requests need more blocks than are free, the newest running request of the lowest priority (the
largest `priority`; with equal priorities simply the newest) is preempted by full release and
re-queued QUEUED at the front (recompute), never by pausing alone: a paused request keeping its seat
would be double-seated when it resumes. Preempting the newest means the oldest running request
always progresses, and every request alone fits the pool (admission refuses those that cannot), so
the queue drains.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.engine.connector.scheduler_side import KvConnectorScheduler
from shared.engine.requests.request import LlmRequest, LlmRequestState
from shared.engine.resources.resource_manager import KVCacheManager, SeqSlotManager

# whether a fresh prompt must wait (QUEUED, holding nothing) before joining this batch
Hold = Callable[[LlmRequest, list[LlmRequest]], bool]


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 32
    max_num_tokens: int = 512  # token budget per step; prompts longer than this are chunked
    # tokens past the context a QUEUED request needs blocks for at admission: 1 (its first
    # generated token) where the node decodes; 0 on a prefill node, whose requests end there
    admit_lookahead: int = 1

    def validate(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {self.max_num_tokens}")


@dataclass
class ScheduledRequest:
    request: LlmRequest
    num_new_tokens: int

    @property
    def completes_context(self) -> bool:
        """After this step every token of the request has K/V: its logits yield a token (the
        drafts it also computes are verified against them)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - len(r.draft_token_ids) == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[LlmRequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        seq_slots: SeqSlotManager,
        release: Callable[[LlmRequest], None],
        *,
        connector: KvConnectorScheduler,
        hold: Hold | None = None,
    ):
        config.validate()
        self.config = config
        self.kv = kv
        self.seq_slots = seq_slots
        self._release = release  # the engine's free_request_resources (sampler, KV, seat)
        self.waiting: deque[LlmRequest] = deque()
        self.running: list[LlmRequest] = []
        self.connector = connector
        # the role's rule (a decode role's ITL bound, slo.py; None on a prefill node). Those
        # behind a held prompt wait too (FCFS); an empty batch is never held, so the queue
        # drains.
        self.hold = hold
        self.num_preemptions = 0  # since start: pdserve_preemptions_total

    def queued_block_need(self) -> int:
        """Blocks the QUEUED requests here (fresh or preempted) need to start: they come before
        anything a node's own admission queue admits after them, so those blocks are theirs.
        Counted without their prefix hits (an upper bound: those are matched at schedule)."""
        lookahead = self.config.admit_lookahead
        return sum(
            self.kv.needed_to_admit(r, lookahead)
            for r in self.waiting
            if r.state == LlmRequestState.QUEUED
        )

    def add_request(self, request: LlmRequest) -> None:
        self.waiting.append(request)

    def remove(self, request: LlmRequest) -> bool:
        """Forget a finished or aborted request (resources are released by the caller)."""
        if request in self.running:
            self.running.remove(request)
            return True
        if request in self.waiting:
            self.waiting.remove(request)
            return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_tokens
        reserved = 0  # blocks promised to requests scheduled this step, allocated in prepare
        budget, reserved = self._schedule_running(out, budget, reserved)
        if not out.preempted:
            self._schedule_waiting(out, budget, reserved)
            self._unwedge(out)
        self.kv.scheduled_tokens = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
        return out

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, reserved: int
    ) -> tuple[int, int]:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._with_drafts(request, budget, reserved)
            need = self.kv.blocks_to_allocate(request, num_new)
            while need > self.kv.num_free_blocks - reserved:
                victim = _victim(self.running[i:])
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget, reserved
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            reserved += need
            i += 1
        return budget, reserved

    def _with_drafts(self, request: LlmRequest, budget: int, reserved: int) -> int:
        """The request's tokens this step: its uncomputed ones and the drafts that fit in the
        budget and the free blocks (drafts never cost another request its place)."""
        uncomputed = request.num_tokens - request.num_computed_tokens
        drafts = request.draft_token_ids
        if drafts:
            keep = max(0, min(len(drafts), budget - uncomputed))
            while keep and (
                self.kv.blocks_to_allocate(request, uncomputed + keep)
                > self.kv.num_free_blocks - reserved
            ):
                keep -= 1
            del drafts[keep:]
        return min(uncomputed + len(drafts), budget)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, reserved: int) -> None:
        """Requests that already hold their blocks (their KV arrived from a prefill node) first,
        then FCFS among those that still need blocks. A holder runs toward its end and frees
        its blocks; behind a fresh request it could wait forever: with one seat, a fresh
        request that needs a holder's block is preempted at its last block, re-queued at the
        front and admitted again, while the holder never gets the seat (found by
        test_properties' PdLifecycle machine: 1-token blocks, 9 of them, batch 1)."""
        free_slots = self.seq_slots.num_free
        fresh_blocked = False
        tables = self.kv.block_tables
        holders = [r for r in self.waiting if r.request_id in tables]
        for request in [*holders, *(r for r in self.waiting if r.request_id not in tables)]:
            if budget <= 0 or free_slots <= 0 or len(self.running) >= self.config.max_batch_size:
                return
            fresh = request.request_id not in tables
            if fresh and fresh_blocked:
                continue
            if fresh and self._held(request):
                fresh_blocked = True
                continue
            if fresh:
                cached = self.kv.acquire_prefix(request)
                request.num_computed_tokens = cached
                if request.num_preemptions == 0:
                    request.cached_tokens = cached
                external = self.connector.external_tokens(request, cached)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            need = self.kv.blocks_to_allocate(request, num_new)
            # incremental reservation: a fresh request starts once its context and first new
            # token fit; it grows as it decodes, and preemption of the newest keeps the oldest
            # progressing
            lookahead = self.config.admit_lookahead
            admit_need = self.kv.needed_to_admit(request, lookahead) if fresh else need
            if max(need, admit_need) > self.kv.num_free_blocks - reserved:
                if fresh:  # give the prefix back; it is matched again next step
                    self.kv.free_resources(request)
                    request.num_computed_tokens = 0
                    fresh_blocked = True
                continue
            if fresh and external:
                num_new = self._load_external(request, external, budget)
            self.waiting.remove(request)
            if request.state == LlmRequestState.QUEUED:
                request.transition(LlmRequestState.CONTEXT_INIT)
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            reserved += need
            free_slots -= 1

    def _load_external(self, request: LlmRequest, external: int, budget: int) -> int:
        """Reserve the blocks for `external` prompt tokens past the prefix hit and hand them to
        the connector, which loads them before this step's forward; they count as computed.
        Returns the tokens left to compute this step (the prompt's last token at least: its
        logits give the first output)."""
        upto = min(request.num_computed_tokens + external, request.prompt_len - 1)
        if upto <= request.num_computed_tokens:
            return min(request.num_tokens - request.num_computed_tokens, budget)
        blocks = self.kv.reserve(request, upto)
        self.connector.after_allocate(request, blocks)
        request.num_computed_tokens = upto
        return min(request.num_tokens - upto, budget)

    def _held(self, request: LlmRequest) -> bool:
        """A new prompt (never run: a preempted one already had its turn) the hold keeps out of
        a non-empty batch."""
        if self.hold is None or not self.running or request.num_preemptions:
            return False
        return self.hold(request, self.running)

    def _unwedge(self, out: SchedulerOutput) -> None:
        """Nothing runs and nothing could be scheduled while waiting requests sit on blocks (all
        waiting for one more block each, say): release the newest of them for recompute, so
        the next step can make progress."""
        if out.scheduled or self.running:
            return
        holder = next(
            (r for r in reversed(self.waiting) if r.request_id in self.kv.block_tables), None
        )
        if holder is None:
            return
        self.waiting.remove(holder)
        self._preempt(holder)
        out.preempted.append(holder)

    def _preempt(self, request: LlmRequest) -> None:
        if request in self.running:
            self.running.remove(request)
        request.draft_token_ids = []
        self._release(request)
        request.transition(LlmRequestState.QUEUED)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)


def _victim(candidates: list[LlmRequest]) -> LlmRequest:
    """The request to preempt among those not yet scheduled this step (oldest first): the
    newest of the lowest priority, so that the oldest of the highest keeps progressing."""
    worst = max(r.sampling_params.service.priority for r in candidates)
    return next(r for r in reversed(candidates) if r.sampling_params.service.priority == worst)
