"""A decode engine's transfer steps driven by hand, through the engine's own reservation path
(`reserve_transfer_blocks`, what the admission queue runs), for tests that place a transfer at
an exact moment instead of waiting on the queue's order."""

from __future__ import annotations

from collections.abc import Sequence

from shared.engine.core import EngineCore
from shared.engine.errors import ResourcesExhausted
from shared.engine.requests.request import FinishReason, LlmRequest, LlmRequestState
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.scheduling.transfer_admission import reserve_transfer_blocks


def reserve_now(
    core: EngineCore, prompt: Sequence[int], params: SamplingParams, request_id: str
) -> tuple[LlmRequest, list[int], int]:
    """Admit a request for a transfer at once: QUEUED -> DISAGG_GENERATION_INIT ->
    TRANS_IN_PROGRESS, the blocks the prefill node fills reserved (minus this node's prefix
    hit) and held by the connector. Returns the request, those blocks and the prompt block
    index of the first of them; raises RequestRejected (bad input) or ResourcesExhausted
    (blocks not free: nothing is held)."""
    table = core.table
    request = table.new(prompt, params, request_id, LlmRequestState.QUEUED)
    request.remote_prefill = True
    grant = reserve_transfer_blocks(core.kv_manager, core.connector, request)
    if grant is None:
        table.finish(request, FinishReason.ABORTED)
        raise ResourcesExhausted(f"no KV blocks free for a {request.prompt_len}-token prompt")
    return request, grant.blocks, grant.first_block
