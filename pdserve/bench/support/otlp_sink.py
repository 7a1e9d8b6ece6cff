"""A minimal OTLP/HTTP traces receiver on loopback: what the tracing benchmark exports to, and
what the tracing tests read the spans back from. It accepts POST /v1/traces (protobuf, gzip or
not), decodes each `ExportTraceServiceRequest` with opentelemetry-proto, and keeps the spans as
plain records; GET /stats answers how many spans and traces arrived. No collector is run: the
point is only to receive and look.

    python -m pdserve.bench.support.otlp_sink   # prints "PORT <n>", serves until killed
"""

from __future__ import annotations

import gzip
import json
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class SpanRecord:
    service: str
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: int  # 0 unset, 1 ok, 2 error
    status_message: str
    events: list[str] = field(default_factory=list)


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    return None if which is None else getattr(v, which)


def decode(body: bytes) -> list[SpanRecord]:
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(
                    SpanRecord(
                        service=str(resource.get("service.name", "")),
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        kind=s.kind,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        status=s.status.code,
                        status_message=s.status.message,
                        events=[e.name for e in s.events],
                    )
                )
    return spans


class OtlpSink:
    """`with OtlpSink() as sink:` serves on 127.0.0.1 (an ephemeral port) in a thread."""

    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []
        self.posts = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces"
                if ok:
                    sink.add(decode(body))
                reply = ExportTraceServiceResponse().SerializeToString() if ok else b""
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def do_GET(self) -> None:
                reply = json.dumps(sink.stats()).encode()
                self.send_response(200 if self.path == "/stats" else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: one line per export is noise in a test's output

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def add(self, spans: list[SpanRecord]) -> None:
        with self._lock:
            self.spans.extend(spans)
            self.posts += 1

    def snapshot(self) -> list[SpanRecord]:
        with self._lock:
            return list(self.spans)

    def stats(self) -> dict[str, int]:
        spans = self.snapshot()
        roots = {s.trace_id for s in spans if s.name == "decode.generate"}
        return {"posts": self.posts, "spans": len(spans), "decode_traces": len(roots)}

    def __enter__(self) -> OtlpSink:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def main() -> None:
    """In its own process, so that decoding exports takes no CPU from whoever measures."""
    with OtlpSink() as sink:
        print(f"PORT {sink.server.server_address[1]}", flush=True)
        sink.thread.join()


if __name__ == "__main__":
    sys.exit(main())
