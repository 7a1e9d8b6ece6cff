"""Conditional (local) prefill: a short prompt is prefilled by the decode node's own engine.

Every remote prefill pays a fixed cost (the `Prefill` RPC hop, engine hand-offs on two nodes,
the transfer set-up) that a short prompt cannot hide, and a short prefill barely disturbs the
decode batch (it rides in one step's token budget beside the decodes). So a request whose
prompt, after this node's own prefix-cache hit, leaves at most `threshold` tokens to compute
is added to this engine's scheduler (QUEUED -> CONTEXT_INIT, chunked prefill, then decode in the
same continuous batch), provided this step's budget has room for it. While the engine is idle
(no live request), the bound is `idle_threshold` instead, and the prompt may take several steps:
nobody's decode shares them, and below ~1k tokens the remote path's fixed cost is more than 5%
of the prefill itself (docs/performance.md, "Local prefill"). These functions run on the
engine thread (inside `EngineThread.call`), where the decision and the add are one atomic step.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.engine.block_manager import BlockHash
from shared.engine.core import EngineCore, ResourcesExhausted
from shared.engine.request import LlmRequest, LlmRequestState
from shared.engine.sampling_params import SamplingParams

S = LlmRequestState


def uncached_tokens(
    core: EngineCore, prompt: Sequence[int], params: SamplingParams, hashes: Sequence[BlockHash]
) -> int:
    """Prompt tokens this node would compute: its prefix-cache hit taken off (none usable
    when prompt logprobs are asked: every position's logits are computed then). `hashes`:
    the prompt's full-block hashes (compute_block_hashes)."""
    if params.prompt_logprobs is not None:
        return len(prompt)
    kv = core.kv_manager
    usable = hashes[: (len(prompt) - 1) // kv.block_size]  # the last token is always computed
    return len(prompt) - len(kv.blocks.match_prefix(usable)) * kv.block_size


def pending_step_tokens(core: EngineCore) -> int:
    """Tokens the scheduler already owes the next step: one per decode, and every uncomputed
    context token of requests still prefilling or waiting to."""
    total = 0
    for request in (*core.scheduler.running, *core.scheduler.waiting):
        if request.state in (S.QUEUED, S.CONTEXT_INIT):
            total += request.num_tokens - request.num_computed_tokens
        else:
            total += 1
    return total


def has_room(core: EngineCore, uncached: int, max_inflight: int) -> bool:
    """The step budget holds this prefill beside what is owed, nothing waits in the admission
    queue ahead of it (FIFO), and an inflight slot is free."""
    if len(core.admission) or len(core.requests) - len(core.admission) >= max_inflight:
        return False
    return pending_step_tokens(core) + uncached <= core.config.max_num_tokens


def try_local(
    core: EngineCore,
    prompt: Sequence[int],
    params: SamplingParams,
    request_id: str,
    threshold: int,
    max_inflight: int,
    idle_threshold: int,
    hashes: Sequence[BlockHash],
) -> LlmRequest | None:
    """Add the request to this engine when it is short enough and fits now; else None.

    Beside live requests: at most `threshold` uncached tokens, fitting this step's budget. On
    an idle engine (no live request: no inter-token latency to protect, no transfer about to
    land): at most `idle_threshold`, chunked over as many steps as it takes. A `threshold` of 0
    turns both off."""
    if threshold <= 0:
        return None
    uncached = uncached_tokens(core, prompt, params, hashes)
    if not core.requests and uncached <= idle_threshold:
        return _add(core, prompt, params, request_id, hashes)
    if uncached > threshold or not has_room(core, uncached, max_inflight):
        return None
    return _add(core, prompt, params, request_id, hashes)


def start_local(
    core: EngineCore,
    prompt: Sequence[int],
    params: SamplingParams,
    request_id: str,
    max_requests: int | None,
    hashes: Sequence[BlockHash],
) -> LlmRequest:
    """A colocated node, or the fallback (no prefill node could serve it): prefill here
    whatever the length; the scheduler holds it QUEUED, holding nothing, until its blocks are
    free. Past `max_requests` live requests (inflight + queued): ResourcesExhausted."""
    core.abort(request_id)  # a transfer reservation made before the prefill nodes failed
    if max_requests is not None and len(core.requests) >= max_requests:
        raise ResourcesExhausted(
            f"admission queue is full ({len(core.requests)} requests in flight or queued, "
            f"--max-inflight + --max-queued = {max_requests}); retry after about 1s",
            1,
        )
    return _add(core, prompt, params, request_id, hashes)


def _add(
    core: EngineCore,
    prompt: Sequence[int],
    params: SamplingParams,
    request_id: str,
    hashes: Sequence[BlockHash],
) -> LlmRequest:
    """Into the scheduler (QUEUED), with the prompt's hashes: scheduling hashes nothing."""
    request = core.add_request(prompt, params, request_id)
    request.prompt_block_hashes = list(hashes)
    return request
