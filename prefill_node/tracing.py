"""The prefill node's spans for one Prefill call (shared/serving/tracing.py: setup, propagation).

`prefill.Prefill` (its parent the decode node's `decode.remote_prefill`, from the call's gRPC
metadata) with request id, prompt and cached tokens, and three children made after the call from
the timestamps in its `TransferStats` (taken on the engine thread and by the push's drain loop,
never an OTel call per layer): `prefill.queue`, `prefill.compute` and `prefill.kv_push` (mode
layerwise or whole, bytes, messages, layers, blocks). A failed call's span has status ERROR
with the gRPC status it answered and the exception as an event.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry.trace import Span, SpanKind

from proto.pdserve.v1 import prefill_pb2
from shared.serving import tracing

Handler = Callable[[Any, prefill_pb2.PrefillRequest, Any], Awaitable[prefill_pb2.PrefillResponse]]


def traced_prefill(fn: Handler) -> Handler:
    """Wraps `PrefillNode.Prefill`; with tracing off it only awaits the handler."""

    @functools.wraps(fn)
    async def prefill(node, request: prefill_pb2.PrefillRequest, context) -> Any:
        if not tracing.enabled():
            return await fn(node, request, context)
        attributes = {
            "pdserve.request_id": request.request_id,
            "pdserve.prompt_tokens": len(request.prompt_token_ids),
        }
        parent = tracing.incoming()  # the decode node's attempt span (gRPC metadata)
        span = tracing.start_span("prefill.Prefill", parent, SpanKind.SERVER, attributes)
        assert span is not None
        try:
            response = await fn(node, request, context)
            _record(span, request, response, node.layout.num_layers)
            return response
        except BaseException as e:
            code = context.code()  # set by context.abort before it raised
            tracing.fail(span, e, f"{code.name}: {context.details()}" if code else None)
            raise
        finally:
            span.end()

    return prefill


def _record(
    span: Span,
    request: prefill_pb2.PrefillRequest,
    response: prefill_pb2.PrefillResponse,
    layers: int,
) -> None:
    stats = response.stats
    computed = int(stats.last_layer_computed_unix * 1e9)
    scheduled = computed - int(stats.prefill_seconds * 1e9)
    queued = scheduled - int(stats.queue_seconds * 1e9)
    span.set_attribute("pdserve.cached_tokens", response.cached_tokens)
    span.set_attribute("pdserve.kv.bytes", stats.bytes_sent)
    tracing.record_span("prefill.queue", span, queued, scheduled)
    computed_tokens = len(request.prompt_token_ids) - response.cached_tokens
    tracing.record_span(
        "prefill.compute", span, scheduled, computed, {"pdserve.computed_tokens": computed_tokens}
    )
    push = {
        "pdserve.kv.mode": "layerwise" if request.layerwise else "whole",
        "pdserve.kv.bytes": stats.bytes_sent,
        "pdserve.kv.messages": stats.messages,
        "pdserve.kv.layers": layers,
        "pdserve.kv.blocks": len(request.destination.block_ids),
    }
    first = int(stats.first_layer_sent_unix * 1e9) or computed
    tracing.record_span("prefill.kv_push", span, first, int(stats.last_byte_sent_unix * 1e9), push)
