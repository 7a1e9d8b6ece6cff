"""The decode side of P/D (and a colocated node): every token is generated here. A prompt is
placed here or on a prefill node (shared/engine/scheduling/placement.py); a remote one waits in the
admission queue, is admitted with blocks reserved and pinned for the KV a prefill node pushes
(DISAGG_GENERATION_INIT, no seat), and becomes schedulable once it has landed."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.engine.commands import Drain, KvLanded, PlacePrompt, TransferFailed
from shared.engine.errors import ResourcesExhausted
from shared.engine.requests.fork import fork_completions
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import FinishReason, LlmRequest, LlmRequestState
from shared.engine.resources.block_manager import NoFreeBlocksError
from shared.engine.roles.role import EngineParts, Handlers
from shared.engine.runtime.model_runner import LayerHook
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.scheduling.placement import Placement, PlacementPolicy
from shared.engine.scheduling.scheduler import ScheduledRequest
from shared.engine.scheduling.slo import SloPolicy
from shared.engine.scheduling.transfer_admission import (
    DEFAULT_MAX_QUEUED,
    AdmissionCallback,
    TransferAdmission,
)

S = LlmRequestState


@dataclass
class DecodeSettings:
    placement: PlacementPolicy = field(default_factory=PlacementPolicy)
    max_queued: int = DEFAULT_MAX_QUEUED
    max_inflight: int | None = None  # requests past the admission queue at once
    slo: SloPolicy = field(default_factory=SloPolicy, compare=False)
    context_only: bool = field(default=False, init=False)

    def build(self, parts: EngineParts) -> DecodeRole:
        return DecodeRole(parts, self)


class DecodeRole:
    context_only = False

    def __init__(self, parts: EngineParts, settings: DecodeSettings | None = None):
        settings = settings or DecodeSettings()
        self.parts = parts
        self.admission = TransferAdmission(parts, settings.max_queued, settings.max_inflight)
        self.admission.slo = settings.slo
        self.placement = Placement(parts, settings.placement, settings.slo, settings.max_inflight)
        parts.requests.on_end.append(self.admission.forget)
        # prompts prefilled here (colocated, local, fallback) join the batch under the same ITL
        # bound as admitted transfers
        slo = settings.slo
        parts.scheduler.hold = lambda request, batch: slo.batch_too_slow(batch, request)

    def handlers(self) -> Handlers:
        return {
            PlacePrompt: self.place,
            KvLanded: lambda c: self.complete_transfer_all(
                c.request_id, c.first_token, c.first_logprobs, c.prompt_logprobs, c.choices
            ),
            TransferFailed: lambda c: self.fail_transfer(c.request_id),
            Drain: lambda c: self.admission.drain(),
        }

    def set_admission_callback(self, callback: AdmissionCallback | None) -> None:
        self.admission.on_admission = callback

    def after_step(self) -> None:
        """Admit what the freed blocks now allow from the queue."""
        self.admission.admit()

    def layer_hook(self, scheduled: Sequence[ScheduledRequest]) -> LayerHook | None:
        return None  # nothing leaves this node per layer

    # ---- placement ------------------------------------------------------------------------
    def place(self, c: PlacePrompt) -> LlmRequest | None:
        """Local (the request) or queued for a transfer (None, its grant comes on the
        admission callback)."""
        if c.fallback:
            return self.placement.start_local(c.prompt, c.params, c.request_id, c.hashes)
        queued = len(self.admission)
        request = self.placement.try_local(c.prompt, c.params, c.request_id, c.hashes, queued)
        if request is None:
            self.admission.enqueue(c.prompt, c.params, c.request_id, c.deadline, c.hashes)
        return request

    # ---- tokens ---------------------------------------------------------------------------
    def accept_token(
        self, request: LlmRequest, token: int, logprobs: TokenLogprobs | None
    ) -> list[TokenDelta]:
        if request.state == S.CONTEXT_INIT:
            request.transition(S.GENERATION_IN_PROGRESS)
        # forks first: they share the prompt's blocks, which a finishing parent gives back
        forks = fork_completions(self.parts, request) if request.choice_first_tokens else []
        delta = self.parts.requests.outputs.process(request, token, logprobs)
        if delta.finish_reason is not None:
            self.parts.requests.finish(request, delta.finish_reason)
        return [delta, *forks]

    # ---- the transfer ---------------------------------------------------------------------
    def reserve_for_transfer(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str = "",
    ) -> tuple[LlmRequest, list[int], int]:
        """Admit a request in DISAGG_GENERATION_INIT at once, bypassing the queue: blocks
        reserved (minus this node's own prefix-cache hit) and pinned for the incoming transfer,
        no seat. Returns the request, the blocks to fill and the prompt block index of the
        first of them."""
        table, kv = self.parts.requests, self.parts.kv_manager
        request = table.new(prompt_token_ids, params, request_id, S.DISAGG_GENERATION_INIT)
        try:
            # the prefill node computes the prompt (and its logprobs): any hit here is usable
            cached = kv.acquire_prefix(request, request.prompt_len - 1)
            request.cached_tokens = cached
            new_blocks = kv.reserve(request, request.prompt_len)
        except NoFreeBlocksError:
            table.finish(request, FinishReason.ABORTED, S.DISAGG_TRANS_ERROR)
            raise ResourcesExhausted(
                f"no KV blocks free for a {request.prompt_len}-token prompt; retry later"
            ) from None
        kv.pin_blocks(request.request_id, new_blocks)
        return request, new_blocks, cached // kv.block_size

    def start_transfer(self, request_id: str) -> None:
        self.parts.requests.live(request_id).transition(S.DISAGG_GENERATION_TRANS_IN_PROGRESS)

    def complete_transfer(
        self,
        request_id: str,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
    ) -> TokenDelta:
        return self.complete_transfer_all(request_id, first_token, first_logprobs, prompt_logprobs)[
            0
        ]

    def complete_transfer_all(
        self,
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
        table, kv = self.parts.requests, self.parts.kv_manager
        request = table.live(request_id)
        if prompt_logprobs is not None:
            request.prompt_logprobs = prompt_logprobs
        # transition first: an illegal call must not drop the pins of a transfer in flight
        request.transition(S.DISAGG_GENERATION_TRANS_COMPLETE)
        kv.unpin_request(request_id)
        request.num_computed_tokens = request.prompt_len
        kv.cache_computed_blocks(request)
        request.first_token_time = time.monotonic()
        request.choice_first_tokens = list(choices)
        forks = fork_completions(self.parts, request) if choices else []
        delta = table.outputs.process(request, first_token, first_logprobs)
        if delta.finish_reason is not None:
            table.finish(request, delta.finish_reason)
        else:
            self.parts.scheduler.add_request(request)
        return [delta, *forks]

    def fail_transfer(self, request_id: str) -> None:
        self.parts.requests.abort(request_id, S.DISAGG_TRANS_ERROR)
