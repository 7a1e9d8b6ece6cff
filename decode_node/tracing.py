"""The decode node's spans for one request (shared/serving/tracing.py: setup and propagation).

`decode.generate` (the root here, its parent the caller's traceparent) wraps the one request
path for gRPC and HTTP alike, with request id, prompt / cached / generated tokens, finish reason
and where the prompt was prefilled and why (`pdserve.placement`, `pdserve.placement.reason`).
Its children: `decode.admission_queue` (remote: waiting for KV blocks), one
`decode.remote_prefill` per Prefill attempt (prefill node, routing, push mode, KV bytes; its
context goes to the prefill node as gRPC metadata) with `decode.kv_landing` under it, or, for a
local prefill, `decode.queue` and `decode.prefill` from the engine's own timestamps. Events:
`first_token`, `seat_granted`. Everything runs on the event loop, once per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from opentelemetry.trace import Span, SpanKind

from decode_node.stream import Stream
from shared.engine.requests.output import TokenDelta
from shared.serving import tracing
from shared.serving.grpc_server import GenerateError

if TYPE_CHECKING:
    from decode_node.config import DecodeNodeConfig
    from decode_node.peers import PrefillPeer
    from proto.pdserve.v1 import prefill_pb2

Deltas = AsyncIterator[tuple[Stream, TokenDelta]]
# request id -> its root span, while in flight: the Prefill attempts' parent
_roots: dict[str, Span] = {}


def traced_generate(fn: Callable[..., Deltas]) -> Callable[..., Deltas]:
    """Wraps `DecodeNode.generate`; with tracing off it returns the generator untouched."""

    @functools.wraps(fn)
    def generate(
        node, rid: str, prompt: list[int], params, deadline: float | None, images=()
    ) -> Deltas:
        deltas = fn(node, rid, prompt, params, deadline, images)
        if not tracing.enabled():
            return deltas
        return _traced(node.config, deltas, rid, len(prompt))

    return generate


async def _traced(config: DecodeNodeConfig, deltas: Deltas, rid: str, prompt_len: int) -> Deltas:
    role = "colocated" if config.colocated else "decode"
    attributes = {"pdserve.request_id": rid, "pdserve.prompt_tokens": prompt_len}
    root = tracing.start_span("decode.generate", tracing.incoming(), SpanKind.SERVER, attributes)
    assert root is not None
    root.set_attribute("pdserve.role", role)
    owner = _roots.setdefault(rid, root) is root  # a duplicate id is refused by generate
    stream: Stream | None = None
    first, seat_pending, finish = True, False, None
    try:
        async with contextlib.aclosing(deltas):
            async for stream, delta in deltas:
                if first:
                    _on_first(config, root, stream)
                    first, seat_pending = False, stream.completing is not None
                elif seat_pending and stream.completing is None:
                    root.add_event("seat_granted")  # the engine took the landed request
                    seat_pending = False
                if delta.finish_reason is not None:
                    finish = delta.finish_reason.value
                yield stream, delta
    except GenerateError as e:
        tracing.fail(root, e, f"{e.code.name}: {e}")
        raise
    except (asyncio.CancelledError, GeneratorExit):
        root.set_attribute("pdserve.cancelled", True)  # the client went away
        raise
    except BaseException as e:
        tracing.fail(root, e)
        raise
    finally:
        if owner:
            _roots.pop(rid, None)
        if stream is not None:
            root.set_attribute("pdserve.generated_tokens", stream.completion_tokens)
        if finish is not None:
            root.set_attribute("pdserve.finish_reason", finish)
        root.end()


def _on_first(config: DecodeNodeConfig, root: Span, stream: Stream) -> None:
    """At the first token: placement and why, the admission wait, a local prefill's compute."""
    now = time.monotonic()
    uncached = stream.prompt_len - stream.cached_tokens
    root.set_attribute("pdserve.cached_tokens", stream.cached_tokens)
    local = stream.local
    if local is None:
        root.set_attribute("pdserve.placement", "remote")
        root.set_attribute("pdserve.placement.reason", _remote_reason(config, uncached))
        if stream.peer is not None:
            root.set_attribute("pdserve.prefill_node", stream.peer.target)
        waited = tracing.wall_ns(stream.admitted_at + stream.admission_wait, now)
        tracing.record_span(
            "decode.admission_queue", root, tracing.wall_ns(stream.admitted_at, now), waited
        )
    else:
        root.set_attribute("pdserve.placement", "local")
        root.set_attribute("pdserve.placement.reason", _local_reason(config, stream, uncached))
        # stamped by the engine thread (monotonic) before this first token reached the loop
        if local.first_scheduled_time is not None:
            seated = tracing.wall_ns(local.first_scheduled_time, now)
            arrived = tracing.wall_ns(local.arrival_time, now)
            tracing.record_span("decode.queue", root, arrived, seated)
            root.add_event("seat_granted", timestamp=seated)
            computed = tracing.wall_ns(local.first_token_time or now, now)
            attributes = {"pdserve.computed_tokens": uncached}
            tracing.record_span("decode.prefill", root, seated, computed, attributes)
    root.add_event("first_token")


def _remote_reason(config: DecodeNodeConfig, uncached: int) -> str:
    if config.local_prefill_tokens <= 0:
        return "--local-prefill-tokens 0: every prompt goes to a prefill node"
    return (
        f"{uncached} uncached tokens over --local-prefill-tokens {config.local_prefill_tokens} "
        f"(or --local-prefill-idle-tokens {config.local_prefill_idle_tokens} while idle), "
        "or no room in this engine's step"
    )


def _local_reason(config: DecodeNodeConfig, stream: Stream, uncached: int) -> str:
    if config.colocated:
        return "colocated node: every prompt is prefilled here"
    if stream.peer is not None:
        return "fallback: no prefill node could serve it"
    if uncached <= config.local_prefill_tokens:
        return f"{uncached} uncached tokens within --local-prefill-tokens"
    if uncached <= config.local_prefill_idle_tokens:
        return f"{uncached} uncached tokens within --local-prefill-idle-tokens (engine idle)"
    return "fallback: no healthy prefill node"


class PrefillAttempt:
    """One Prefill RPC's span (a no-op when tracing is off or the request has no root)."""

    def __init__(self, span: Span | None) -> None:
        self.span = span
        self.metadata = tracing.metadata(span)
        self.landed_ns: int | None = None

    @classmethod
    def start(
        cls,
        config: DecodeNodeConfig,
        stream: Stream,
        peer: PrefillPeer,
        request: prefill_pb2.PrefillRequest,
        uncached: int,
    ) -> PrefillAttempt:
        root = _roots.get(stream.request_id) if tracing.enabled() else None
        if root is None:
            return _OFF
        attributes = {
            "pdserve.prefill_node": peer.target,
            "pdserve.prefill_id": stream.prefill_id,
            "pdserve.prefill_routing": config.prefill_routing,
            "pdserve.predicted_cached_tokens": len(request.prompt_token_ids) - uncached,
            "pdserve.kv.mode": "layerwise" if request.layerwise else "whole",
            "pdserve.kv.blocks": len(request.destination.block_ids),
        }
        return cls(tracing.start_span("decode.remote_prefill", root, SpanKind.CLIENT, attributes))

    def watch(self, landed: asyncio.Future[object]) -> None:
        """Note when every layer of every block has landed here."""
        if self.span is not None:
            landed.add_done_callback(lambda _: setattr(self, "landed_ns", time.time_ns()))

    def fail(self, error: BaseException) -> None:
        if self.span is not None:
            tracing.fail(self.span, error)
            self.span.end()

    def done(self, response: prefill_pb2.PrefillResponse) -> None:
        if self.span is None:
            return
        stats = response.stats
        self.span.set_attribute("pdserve.cached_tokens", response.cached_tokens)
        self.span.set_attribute("pdserve.kv.bytes", stats.bytes_sent)
        landed = self.landed_ns or time.time_ns()
        # from the prefill node's first KV message (its clock) until the last layer landed here
        first = int(stats.first_layer_sent_unix * 1e9) or landed
        tracing.record_span("decode.kv_landing", self.span, first, landed)
        self.span.end()


_OFF = PrefillAttempt(None)
