"""The decode side of P/D (and a colocated node): every token is generated here. A prompt is
placed here or on a prefill node (shared/engine/scheduling/placement.py); a remote one waits in the
admission queue, is admitted with blocks reserved and pinned for the KV a prefill node pushes
(DISAGG_GENERATION_INIT, no seat), and becomes schedulable once it has landed."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.engine.commands import Drain, KvLanded, PlacePrompt, TransferFailed
from shared.engine.connector.base import KvConnector
from shared.engine.connector.kv_landing import KvLandingConnector
from shared.engine.connector.multi import MultiConnector
from shared.engine.connector.offload import OffloadConnector, OffloadStats
from shared.engine.connector.offload_config import OffloadConfig
from shared.engine.events import Admitted
from shared.engine.requests.fork import fork_completions
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import FinishReason, LlmRequest, LlmRequestState
from shared.engine.resources.resource_manager import KVCacheManager
from shared.engine.roles.role import Emit, EngineParts, Handlers
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.engine.scheduling.placement import Placement, PlacementPolicy
from shared.engine.scheduling.scheduler import Hold
from shared.engine.scheduling.slo import SloPolicy
from shared.engine.scheduling.transfer_admission import DEFAULT_MAX_QUEUED, TransferAdmission

S = LlmRequestState


@dataclass
class DecodeSettings:
    placement: PlacementPolicy = field(default_factory=PlacementPolicy)
    max_queued: int = DEFAULT_MAX_QUEUED
    max_inflight: int | None = None  # requests past the admission queue at once
    slo: SloPolicy = field(default_factory=SloPolicy, compare=False)
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # KV tiers below the pool
    # what the tiers count, for the node's /metrics
    offload_stats: OffloadStats = field(default_factory=OffloadStats, compare=False)
    context_only: bool = field(default=False, init=False)

    def connector(self, kv: KVCacheManager) -> KvConnector:
        """Pushes land first (a remote prompt is the prefill node's); the tiers supply the
        prompts prefilled here."""
        landing = KvLandingConnector(kv)
        if not self.offload.enabled:
            return landing
        return MultiConnector([landing, OffloadConnector(kv, self.offload, self.offload_stats)])

    def hold(self) -> Hold:
        """Prompts prefilled here (colocated, local, fallback) join the batch under the same ITL
        bound as admitted transfers."""
        slo = self.slo
        return lambda request, batch: slo.batch_too_slow(batch, request)

    def drafting(self) -> DecodeSettings:
        return DecodeSettings()

    def build(self, parts: EngineParts) -> DecodeRole:
        return DecodeRole(parts, self)


class DecodeRole:
    context_only = False

    def __init__(self, parts: EngineParts, settings: DecodeSettings):
        self.parts = parts
        self.admission = TransferAdmission(parts, settings.max_queued, settings.max_inflight)
        self.admission.slo = settings.slo
        self.placement = Placement(parts, settings.placement, settings.slo, settings.max_inflight)
        parts.requests.on_end.append(self.admission.forget)

    def handlers(self) -> Handlers:
        return {
            PlacePrompt: self.place,
            KvLanded: lambda c: self.complete_transfer(
                c.request_id,
                c.first_token,
                c.first_logprobs,
                c.prompt_logprobs,
                c.choices,
                c.mrope_delta,
            ),
            TransferFailed: lambda c: self.fail_transfer(c.request_id),
            Drain: lambda c: self.admission.drain(),
        }

    def bind(self, emit: Emit) -> None:
        self.admission.on_admission = lambda rid, grant: emit(Admitted(rid, grant))

    def after_step(self) -> None:
        """Admit what the freed blocks now allow from the queue."""
        self.admission.admit()

    # ---- placement ------------------------------------------------------------------------
    def place(self, c: PlacePrompt) -> LlmRequest | None:
        """Local (the request) or queued for a transfer (None, its grant comes as an
        `Admitted` event)."""
        if c.fallback:
            return self.placement.start_local(c.prompt, c.params, c.request_id, c.hashes, c.images)
        queued = len(self.admission)
        request = self.placement.try_local(
            c.prompt, c.params, c.request_id, c.hashes, queued, c.images
        )
        if request is None:
            self.admission.enqueue(c.prompt, c.params, c.request_id, c.deadline, c.hashes, c.images)
        return request

    # ---- tokens ---------------------------------------------------------------------------
    def accept_tokens(
        self,
        request: LlmRequest,
        tokens: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None],
    ) -> list[TokenDelta]:
        if request.state == S.CONTEXT_INIT:
            request.transition(S.GENERATION_IN_PROGRESS)
        # forks first: they share the prompt's blocks, which a finishing parent gives back
        forks = fork_completions(self.parts, request) if request.choice_first_tokens else []
        delta = self.parts.requests.outputs.process_tokens(request, tokens, logprobs)
        if delta.finish_reason is not None:
            self.parts.requests.finish(request, delta.finish_reason)
        return [delta, *forks]

    def end_with_error(
        self, request: LlmRequest, token: int, logprobs: TokenLogprobs | None, reason: str
    ) -> list[TokenDelta]:
        """Ended here, its seat and blocks back now; `token` is not the client's."""
        ended = FinishReason.ABORTED
        self.parts.requests.finish(request, ended)
        index = request.choice_index
        return [TokenDelta(request.group_id, [], "", ended, index=index, error=reason)]

    # ---- the transfer ---------------------------------------------------------------------
    def complete_transfer(
        self,
        request_id: str,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
        choices: Sequence[tuple[int, TokenLogprobs | None]] = (),
        mrope_delta: int = 0,
    ) -> list[TokenDelta]:
        """All KV landed: the request becomes schedulable (its seat comes at the next prepare,
        with `mrope_delta`, the prefill node's, in the seat's delta row);
        the first token, sampled on the prefill node, is processed at once, with the logprobs
        the prefill node computed for it and for the prompt. n > 1: `choices` are the other
        completions' first tokens; they are forked off the landed KV here (deltas after the
        request's own)."""
        table = self.parts.requests
        request = table.live(request_id)
        if prompt_logprobs is not None:
            request.prompt_logprobs = prompt_logprobs
        # transition first: an illegal call must not drop the pins of a transfer in flight
        request.transition(S.DISAGG_GENERATION_TRANS_COMPLETE)
        request.mrope_delta = mrope_delta
        self.parts.connector.finish_load(request)
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
