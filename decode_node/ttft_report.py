"""The decode node's SLO report when a first token reaches its event loop
(shared/engine/scheduling/slo.py):
the TTFT histogram, the measured prefill rate and the prediction's error. The predictions and
refusals themselves are made by the engine (shared/engine/scheduling/transfer_admission.py,
shared/engine/scheduling/placement.py).
"""

from __future__ import annotations

from decode_node.stream import Stream
from shared.engine.scheduling.slo import SloPolicy
from shared.serving.grpc_server import NodeMetrics
from shared.serving.metrics import ttft_prediction_error_histogram


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
