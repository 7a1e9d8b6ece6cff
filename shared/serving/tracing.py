"""OpenTelemetry traces: one request followed through the proxy, a decode node and a prefill node.

Off unless an OTLP/HTTP endpoint is configured (`--otlp-traces-endpoint URL`, or the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`). Off, no provider, exporter
or SDK import is made and every helper here returns at its first line, so the request path pays
one `None` check. On, each process has one `TracerProvider` (service.name pdserve-decode,
pdserve-prefill or pdserve-proxy) with a `BatchSpanProcessor` (export happens on its own thread),
flushed by `shutdown` when the process stops.

The W3C `traceparent` / `tracestate` come in as gRPC metadata (`server_interceptors`, on every
node's gRPC server) or HTTP headers (`set_incoming`), and go out the same way (`inject`). Spans are
made only on the event loop: what the engine thread did is known from the timestamps it already
records (monotonic), turned into explicit span start and end times (`wall_ns`).
"""

from __future__ import annotations

import argparse
import contextvars
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from grpc import aio
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None
_provider: TracerProvider | None = None
# the caller's trace context of the request this task serves (set per gRPC call / HTTP request)
_incoming: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "pdserve_trace_incoming", default=None
)

Attributes = Mapping[str, Any]


def endpoint_from(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The OTLP/HTTP traces URL: the flag (a bare host:port URL gets /v1/traces), else
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as is, else OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces
    (the OTLP spec's rules); None: tracing off."""
    if flag:
        return flag if urlsplit(flag).path not in ("", "/") else flag.rstrip("/") + "/v1/traces"
    if traces := environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return traces
    if base := environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return base.rstrip("/") + "/v1/traces"
    return None


def endpoint_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> argparse.Action:
    """vLLM's flag, on every node command, `up` (passed on to its nodes) and the proxy."""
    return p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces over OTLP/HTTP to URL (e.g. http://collector:4318; "
        "a bare URL gets /v1/traces); default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
        "OTEL_EXPORTER_OTLP_ENDPOINT if set, else tracing is off",
    )


def setup(service: str, flag: str | None = None) -> bool:
    """Turn tracing on for this process when an endpoint is configured; returns whether on."""
    global _tracer, _provider
    endpoint = endpoint_from(flag)
    if endpoint is None:
        log.info("tracing off (no --otlp-traces-endpoint or OTEL_EXPORTER_OTLP_*ENDPOINT)")
        return False
    # imported only when on: a node without tracing never loads the SDK or the exporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _provider, _tracer = provider, provider.get_tracer("pdserve")
    log.warning("tracing on: %s exports spans over OTLP/HTTP to %s", service, endpoint)
    return True


def shutdown() -> None:
    """Export what is still buffered (bounded by the exporter's timeout) and turn tracing off."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer, _provider = None, None


def enabled() -> bool:
    return _tracer is not None


# ---- propagation --------------------------------------------------------------------------
def extract(carrier: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None) -> Context:
    """The trace context in gRPC metadata pairs or an HTTP header mapping (empty if none)."""
    if carrier is None:
        return Context()
    if not isinstance(carrier, Mapping):
        carrier = {k: v for k, v in carrier if k in TRACE_HEADERS and isinstance(v, str)}
    return _PROPAGATOR.extract(carrier)


def set_incoming(carrier: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None) -> None:
    """Record the caller's trace context for the request this task serves (no-op when off)."""
    if _tracer is not None:
        _incoming.set(extract(carrier))


def incoming() -> Context | None:
    return _incoming.get()


def inject(pairs: list[tuple[str, Any]], span: Span | None) -> list[tuple[str, Any]]:
    """`pairs` (gRPC metadata or HTTP headers) with the trace headers replaced by `span`'s."""
    if span is None:
        return pairs
    out: dict[str, str] = {}
    _PROPAGATOR.inject(out, trace.set_span_in_context(span))
    return [(k, v) for k, v in pairs if k.lower() not in TRACE_HEADERS] + list(out.items())


def metadata(span: Span | None) -> list[tuple[str, str]] | None:
    """gRPC metadata carrying `span` as the parent of the callee's spans (None when off)."""
    return None if span is None else inject([], span)


class _Incoming(aio.ServerInterceptor):
    """Reads the caller's trace context before the handler runs, in the call's own task."""

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        _incoming.set(extract(handler_call_details.invocation_metadata))
        return await continuation(handler_call_details)


def server_interceptors() -> list[aio.ServerInterceptor]:
    """For every node's gRPC server: none when off (no per-call cost)."""
    return [] if _tracer is None else [_Incoming()]


# ---- spans --------------------------------------------------------------------------------
def wall_ns(monotonic: float, now: float | None = None) -> int:
    """A time.monotonic() reading as Unix nanoseconds (span times are wall-clock)."""
    now = time.monotonic() if now is None else now
    return time.time_ns() - int((now - monotonic) * 1e9)


def start_span(
    name: str,
    parent: Context | Span | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
    start_ns: int | None = None,
) -> Span | None:
    """A started span (None when off); `parent` a span, an extracted context, or none."""
    if _tracer is None:
        return None
    context = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
    return _tracer.start_span(name, context, kind, attributes, start_time=start_ns)


def record_span(
    name: str,
    parent: Span | None,
    start_ns: int,
    end_ns: int,
    attributes: Attributes | None = None,
) -> None:
    """A finished span with explicit times (from timestamps taken elsewhere)."""
    span = start_span(name, parent, attributes=attributes, start_ns=start_ns)
    if span is not None:
        span.end(end_time=max(start_ns, end_ns))


def fail(span: Span | None, error: BaseException, description: str | None = None) -> None:
    """Status ERROR with the error's text, and the exception as an event."""
    if span is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, description or f"{type(error).__name__}: {error}"))


def error_status(span: Span | None, description: str) -> None:
    if span is not None:
        span.set_status(Status(StatusCode.ERROR, description))


def server_span(
    name: str,
    carrier: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None,
    attributes: Attributes | None = None,
) -> Span | None:
    """A SERVER span whose parent is the trace context in `carrier` (None when off)."""
    if _tracer is None:
        return None
    return start_span(name, extract(carrier), SpanKind.SERVER, attributes)


def attempt(span: Span | None, backend: str, outcome: str, ok: bool) -> None:
    """One try on a backend (the proxy's): an event, and the span's status so far."""
    if span is not None:
        span.add_event("attempt", {"pdserve.backend": backend, "pdserve.outcome": outcome})
        span.set_attribute("pdserve.backend", backend)
        span.set_status(Status(StatusCode.OK if ok else StatusCode.ERROR, None if ok else outcome))


def end(span: Span | None) -> None:
    if span is not None:
        span.end()


def end_with(span: Span | None, release: Callable[[], None]) -> Callable[[], None]:
    """`release`, then `span` ended: for work that finishes in a callback (a relayed body)."""
    if span is None:
        return release

    def both() -> None:
        try:
            release()
        finally:
            span.end()

    return both
