"""The decode node's SLO hooks outside the transfer queue (shared/engine/slo.py): the TTFT check
for prompts prefilled by this node's own engine (a colocated node, or the fallback), and the
first token's report (the measured prefill rate, the prediction's error).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from decode_node.local_prefill import start_local
from decode_node.stream import Stream
from shared.engine.block_manager import BlockHash
from shared.engine.core import EngineCore
from shared.engine.request import LlmRequest
from shared.engine.sampling_params import SamplingParams
from shared.engine.slo import SloPolicy, tokens_still_to_prefill
from shared.serving.grpc_server import NodeMetrics
from shared.serving.metrics import ttft_prediction_error_histogram


def start_local_within_slo(
    core: EngineCore,
    prompt: Sequence[int],
    params: SamplingParams,
    request_id: str,
    max_requests: int | None,
    hashes: Sequence[BlockHash],
) -> LlmRequest:
    """`start_local`, refused first (SloMiss, nothing allocated) when the prompt tokens still
    to prefill here, this one's included, miss its TTFT target at the measured rate."""
    slo = core.admission.slo
    core.validate_request(prompt, params)
    ahead = tokens_still_to_prefill(r for r in core.requests.values() if r.request_id != request_id)
    slo.check_ttft(request_id, len(prompt), ahead, params.service)
    request = start_local(core, prompt, params, request_id, max_requests, hashes)
    slo.rate.started(request_id, len(prompt), time.monotonic())
    return request


def observe_ttft(metrics: NodeMetrics, slo: SloPolicy, stream: Stream) -> float:
    """The first token reached the event loop: the TTFT histogram, the prefill rate's sample
    and the prediction's error. Returns the TTFT (seconds since the request arrived)."""
    assert stream.first_token_at is not None
    ttft = stream.first_token_at - stream.admitted_at
    metrics.ttft.observe(ttft)
    if slo.on_error is None:  # the node's registry is known only here
        slo.on_error = ttft_prediction_error_histogram(metrics.registry).observe
    slo.first_token(stream.request_id, ttft, stream.first_token_at)
    return ttft
