"""Where a decode node's prompt is prefilled: by this engine (local) or by a prefill node (remote).

Every remote prefill pays a fixed cost (the `Prefill` RPC hop, engine hand-offs on two nodes,
the transfer set-up) that a short prompt cannot hide, and a short prefill barely disturbs the
decode batch (it rides in one step's token budget beside the decodes). So a request whose
prompt, after this node's own prefix-cache hit, leaves at most `local_prefill_tokens` to compute
is added to this engine's scheduler (QUEUED -> CONTEXT_INIT, chunked prefill, then decode in the
same continuous batch), provided this step's budget has room for it. While the engine is idle
(no live request), the bound is `local_prefill_idle_tokens` instead, and the prompt may take
several steps: nobody's decode shares them, and below ~1k tokens the remote path's fixed cost is
more than 5% of the prefill itself (docs/performance.md, "Local prefill"). The decision reads
this engine's own state and is made on the engine thread, in the same step as the add.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from shared.engine.errors import ResourcesExhausted
from shared.engine.requests.multimodal import PromptImage
from shared.engine.requests.request import LlmRequest, LlmRequestState
from shared.engine.resources.block_manager import BlockHash
from shared.engine.roles.role import EngineParts
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.scheduling.slo import SloPolicy, tokens_still_to_prefill

S = LlmRequestState


@dataclass(frozen=True)
class PlacementPolicy:
    local_prefill_tokens: int = 0  # beside live requests, within the step's budget; 0: never
    local_prefill_idle_tokens: int = 0  # on an idle engine, over as many steps as it takes
    # live requests (inflight + queued) a fallback or colocated prefill may join; None: any
    max_local_requests: int | None = None


class Placement:
    def __init__(
        self,
        parts: EngineParts,
        policy: PlacementPolicy,
        slo: SloPolicy,
        max_inflight: int | None = None,
    ):
        self.parts = parts
        self.policy = policy
        self.slo = slo
        self.max_inflight = max_inflight  # requests past admission at once (the queue's bound)

    def try_local(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str,
        hashes: Sequence[BlockHash],
        queued_for_transfer: int,
        images: Sequence[PromptImage] = (),
    ) -> LlmRequest | None:
        """Add the request to this engine when it is short enough and fits now; else None.

        Beside live requests: at most `local_prefill_tokens` uncached tokens, fitting this
        step's budget, nothing queued for a transfer ahead of it (FIFO) and an inflight slot
        free. On an idle engine (no live request: no inter-token latency to protect, no
        transfer about to land): at most `local_prefill_idle_tokens`. A `local_prefill_tokens`
        of 0 turns both off."""
        policy = self.policy
        if policy.local_prefill_tokens <= 0:
            return None
        uncached = self.uncached_tokens(prompt, params, hashes)
        idle = not len(self.parts.requests) and uncached <= policy.local_prefill_idle_tokens
        if not idle and (
            uncached > policy.local_prefill_tokens
            or not self._has_room(uncached, queued_for_transfer)
        ):
            return None
        return self._add(prompt, params, request_id, hashes, images)

    def start_local(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str,
        hashes: Sequence[BlockHash],
        images: Sequence[PromptImage] = (),
    ) -> LlmRequest:
        """A colocated node, or the fallback (no prefill node could serve it): prefill here
        whatever the length; the scheduler holds it QUEUED, holding nothing, until its blocks
        are free. Refused first (nothing allocated) past `max_local_requests` live requests
        (ResourcesExhausted), or when the prompt tokens still to prefill here, this one's
        included, miss its TTFT target at the measured rate (SloMiss)."""
        table = self.parts.requests
        table.abort(request_id)  # a transfer reservation made before the prefill nodes failed
        table.limits.check(prompt, params)
        bound = self.policy.max_local_requests
        if bound is not None and len(table) >= bound:
            raise ResourcesExhausted(
                f"admission queue is full ({len(table)} requests in flight or queued, "
                f"--max-inflight + --max-queued = {bound}); retry after about 1s",
                1,
            )
        ahead = tokens_still_to_prefill(table)
        self.slo.check_ttft(request_id, len(prompt), ahead, params.service)
        request = self._add(prompt, params, request_id, hashes, images)
        self.slo.rate.started(request_id, len(prompt), time.monotonic())
        return request

    def uncached_tokens(
        self, prompt: Sequence[int], params: SamplingParams, hashes: Sequence[BlockHash]
    ) -> int:
        """Prompt tokens this node would compute: its prefix-cache hit taken off (none usable
        when prompt logprobs are asked: every position's logits are computed then)."""
        if params.prompt_logprobs is not None:
            return len(prompt)
        kv = self.parts.kv_manager
        usable = hashes[: (len(prompt) - 1) // kv.block_size]  # the last token is always computed
        return len(prompt) - len(kv.blocks.match_prefix(usable)) * kv.block_size

    def pending_step_tokens(self) -> int:
        """Tokens the scheduler already owes the next step: each decode's (one, or the several a
        multi-token step left), and every uncomputed context token of requests still
        prefilling or waiting to."""
        scheduler = self.parts.scheduler
        total = 0
        for request in (*scheduler.running, *scheduler.waiting):
            if request.state in (S.QUEUED, S.CONTEXT_INIT):
                total += request.num_tokens - request.num_computed_tokens
            else:
                total += request.step_tokens
        return total

    def _has_room(self, uncached: int, queued_for_transfer: int) -> bool:
        live = len(self.parts.requests) - queued_for_transfer
        full = self.max_inflight is not None and live >= self.max_inflight
        if queued_for_transfer or full:
            return False
        return self.pending_step_tokens() + uncached <= self.parts.config.max_num_tokens

    def _add(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str,
        hashes: Sequence[BlockHash],
        images: Sequence[PromptImage] = (),
    ) -> LlmRequest:
        """Into the scheduler (QUEUED), with the prompt's hashes: scheduling hashes nothing."""
        request = self.parts.requests.new(prompt, params, request_id, S.QUEUED, images)
        request.prompt_block_hashes = list(hashes)
        self.parts.scheduler.add_request(request)
        return request
