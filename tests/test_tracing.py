"""OpenTelemetry traces across real processes: a proxy, a decode node and a prefill node export
over OTLP/HTTP to a receiver in this test; one request through the proxy (HTTP, then gRPC) is one
trace whose spans come from all three services, parented proxy -> decode -> prefill, with the KV
push's bytes on the prefill node's span. Off (no endpoint), nothing is created or exported."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.bench.support.otlp_sink import OtlpSink, SpanRecord
from pdserve.cli.engine_args import engine_argv
from pdserve.cli.parser import build_parser
from pdserve.cluster import NodeProcess, spawn, stop_all, wait_ready
from proto.pdserve.v1 import generation_pb2, generation_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from shared.serving import tracing

MODEL = "tiny"
ROOT = Path(__file__).resolve().parents[1]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PROMPT = " ".join(f"word{i}" for i in range(60))  # several blocks: a real KV push


def test_endpoint_follows_the_flag_then_the_otlp_environment() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}
    assert tracing.endpoint_from(None, {}) is None
    assert tracing.endpoint_from("http://x:4318", env) == "http://x:4318/v1/traces"
    assert tracing.endpoint_from("http://x:4318/custom", env) == "http://x:4318/custom"
    assert tracing.endpoint_from(None, env) == "http://c:4318/v1/traces"
    both = {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/v1/traces"}
    assert tracing.endpoint_from(None, both) == "http://t:1/v1/traces"


def test_up_passes_the_endpoint_on_to_its_nodes() -> None:
    parser = build_parser()
    up = parser.parse_args(["up", "--otlp-traces-endpoint", "http://c:4318"])
    argv = engine_argv(up)
    assert argv == ["--otlp-traces-endpoint", "http://c:4318"]
    assert parser.parse_args(["prefill", *argv]).otlp_traces_endpoint == "http://c:4318"
    proxy = parser.parse_args(["proxy", "--backend", "h:1", "--otlp-traces-endpoint", "u"])
    assert proxy.otlp_traces_endpoint == "u"


def test_off_creates_no_provider_or_exporter() -> None:
    """In a fresh interpreter with no endpoint: setup refuses, the SDK is never imported, and
    every helper is a no-op."""
    code = (
        "import sys\n"
        "from shared.serving import tracing\n"
        "assert tracing.setup('pdserve-decode', None) is False\n"
        "assert not tracing.enabled() and tracing.server_interceptors() == []\n"
        "assert tracing.start_span('x') is None and tracing.metadata(None) is None\n"
        "tracing.set_incoming([('traceparent', 'x')]); assert tracing.incoming() is None\n"
        "assert tracing.inject([('a', 'b')], None) == [('a', 'b')]\n"
        "loaded = [m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
        "'opentelemetry.exporter'))]\n"
        "assert not loaded, loaded\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[OtlpSink, dict[str, int], Callable[[], None]]]:
    """prefill + decode (remote prefill always) + proxy, all exporting to one receiver."""
    with OtlpSink() as sink:
        env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "200"}
        otlp = ["--otlp-traces-endpoint", sink.endpoint]
        nodes: list[NodeProcess] = []
        stopped = False

        def stop() -> None:
            nonlocal stopped
            if not stopped:
                stopped = True
                stop_all(nodes, grace=20)

        try:
            args = ["--model", MODEL, "--port", "0", "--metrics-port", "-1", *otlp]
            nodes.append(spawn("prefill", args, echo=False, env=env))
            wait_ready(nodes, 180)
            prefill = f"127.0.0.1:{nodes[0].info['port']}"
            args = ["--model", MODEL, "--port", "0", "--http-port", "0", "--metrics-port", "-1"]
            args += ["--prefill", prefill, "--local-prefill-tokens", "0", *otlp]
            nodes.append(spawn("decode", args, echo=False, env=env))
            wait_ready(nodes, 180)
            decode = nodes[1].info
            args = ["--backend", f"127.0.0.1:{decode['port']}", "--port", "0", "--http-port", "0"]
            args += ["--backend-http-port", str(decode["http_port"]), *otlp]
            nodes.append(spawn("proxy", args, echo=False, env=env))
            wait_ready(nodes, 60)
            ports = {"grpc": int(nodes[2].info["port"]), "http": int(nodes[2].info["http_port"])}
            ports["prefill"] = int(nodes[0].info["port"])
            yield sink, ports, stop
        finally:
            stop()


def _trace(sink: OtlpSink, trace_id: str, want: set[str], timeout: float = 30) -> list[SpanRecord]:
    """The trace's spans once every name in `want` has arrived (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in sink.snapshot() if s.trace_id == trace_id]
        if want <= {s.name for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def _one(spans: list[SpanRecord], name: str) -> SpanRecord:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.service, s.name) for s in spans])
    return found[0]


FULL = {
    "proxy.route",
    "decode.generate",
    "decode.admission_queue",
    "decode.remote_prefill",
    "decode.kv_landing",
    "prefill.Prefill",
    "prefill.queue",
    "prefill.compute",
    "prefill.kv_push",
}


def _check_one_request(spans: list[SpanRecord], generated: int) -> None:
    assert {s.service for s in spans} == {"pdserve-proxy", "pdserve-decode", "pdserve-prefill"}
    proxy, root = _one(spans, "proxy.route"), _one(spans, "decode.generate")
    attempt, prefill = _one(spans, "decode.remote_prefill"), _one(spans, "prefill.Prefill")
    push = _one(spans, "prefill.kv_push")
    assert proxy.service == "pdserve-proxy" and root.service == "pdserve-decode"
    assert prefill.service == "pdserve-prefill"
    assert root.parent_id == proxy.span_id  # the traceparent the proxy sent on
    assert attempt.parent_id == root.span_id
    assert prefill.parent_id == attempt.span_id  # gRPC metadata of the Prefill RPC
    assert push.parent_id == prefill.span_id
    assert _one(spans, "decode.admission_queue").parent_id == root.span_id
    assert _one(spans, "decode.kv_landing").parent_id == attempt.span_id
    assert push.attributes["pdserve.kv.bytes"] > 0
    assert push.attributes["pdserve.kv.layers"] > 0 and push.attributes["pdserve.kv.blocks"] > 0
    assert push.attributes["pdserve.kv.mode"] in ("layerwise", "whole")
    assert attempt.attributes["pdserve.kv.bytes"] == push.attributes["pdserve.kv.bytes"]
    a = root.attributes
    assert a["pdserve.placement"] == "remote" and a["pdserve.prefill_node"]
    assert a["pdserve.prompt_tokens"] > 16 and a["pdserve.cached_tokens"] >= 0
    assert a["pdserve.generated_tokens"] == generated and a["pdserve.finish_reason"] == "length"
    assert {"first_token", "seat_granted"} <= set(root.events)
    assert all(s.status != 2 for s in spans), [(s.name, s.status_message) for s in spans]
    assert proxy.start_ns <= root.start_ns <= prefill.start_ns <= prefill.end_ns <= root.end_ns


def test_one_http_request_is_one_trace_across_three_processes(traced) -> None:
    sink, ports, _ = traced
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}
    url = f"http://127.0.0.1:{ports['http']}/v1/completions"
    answer = httpx.post(url, json=body, headers={"traceparent": parent}, timeout=120)
    assert answer.status_code == 200, answer.text
    spans = _trace(sink, CLIENT_TRACE, FULL)
    _check_one_request(spans, generated=5)
    assert _one(spans, "proxy.route").parent_id == CLIENT_SPAN  # the client's traceparent


def _generate(stub, rid: str, max_tokens: int, metadata: list[tuple[str, str]]):
    request = generation_pb2.GenerateRequest(
        request_id=rid,
        text=PROMPT,
        sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    return stub.Generate(request, metadata=metadata, timeout=120)


def test_grpc_requests_carry_the_trace_and_errors_are_recorded(traced) -> None:
    sink, ports, stop = traced
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    metadata = [("traceparent", f"00-{trace_id}-b7ad6b7169203331-01")]
    with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        assert len(list(_generate(stub, "traced-grpc", 4, metadata))) >= 1
        # the same request id while the first is in flight: refused inside the request path
        err_trace = "1af7651916cd43dd8448eb211c80319c"
        err_md = [("traceparent", f"00-{err_trace}-b7ad6b7169203331-01")]
        first = _generate(stub, "dup", 200, [])
        next(first)  # in flight on the decode node now
        with pytest.raises(grpc.RpcError) as refused:
            list(_generate(stub, "dup", 4, err_md))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        first.cancel()
    spans = _trace(sink, trace_id, FULL)
    _check_one_request(spans, generated=4)
    failed = _trace(sink, err_trace, {"proxy.route", "decode.generate"})
    root = _one(failed, "decode.generate")
    assert root.status == 2 and "INVALID_ARGUMENT" in root.status_message
    assert "exception" in root.events
    assert _one(failed, "proxy.route").status == 2
    _prefill_refusal_is_an_error_span(sink, ports["prefill"])
    stop()  # the nodes flush on the way out: nothing is lost at shutdown
    cancelled = [s for s in sink.snapshot() if s.attributes.get("pdserve.request_id") == "dup"]
    assert any(s.attributes.get("pdserve.cancelled") for s in cancelled), cancelled


def _prefill_refusal_is_an_error_span(sink: OtlpSink, port: int) -> None:
    """A Prefill the prefill node refuses (a KV layout it does not have): its span says which
    status it answered, with the exception as an event."""
    trace_id = "2af7651916cd43dd8448eb211c80319c"
    metadata = [("traceparent", f"00-{trace_id}-b7ad6b7169203331-01")]
    request = prefill_pb2.PrefillRequest(request_id="wrong-layout")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Prefill(request, metadata=metadata, timeout=30)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    span = _one(_trace(sink, trace_id, {"prefill.Prefill"}), "prefill.Prefill")
    assert span.parent_id == "b7ad6b7169203331" and span.service == "pdserve-prefill"
    assert span.status == 2 and span.status_message.startswith("FAILED_PRECONDITION: KV layout")
    assert "exception" in span.events


def test_a_local_prefill_is_traced_from_the_engine_timestamps() -> None:
    """A colocated node (in-process, tracing on): the HTTP request's traceparent is honoured, the
    span says where the prompt was prefilled and why, and the engine thread's timestamps become
    the queue and prefill spans."""
    import asyncio

    from decode_node.config import DecodeNodeConfig
    from decode_node.server import DecodeNode
    from shared.engine.config import EngineConfig

    async def main() -> None:
        engine = EngineConfig(model=MODEL, num_kv_blocks=256, max_batch_size=8)
        cfg = DecodeNodeConfig(engine=engine, colocated=True, port=0, metrics_port=-1, http_port=0)
        node = DecodeNode(cfg)
        await node.start()
        try:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
            parent = {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}
            async with httpx.AsyncClient(timeout=120) as client:
                url = f"http://127.0.0.1:{node.http_port}/v1/completions"
                answer = await client.post(url, json=body, headers=parent)
            assert answer.status_code == 200, answer.text
        finally:
            assert await node.stop(grace=1.0)

    trace_id = "3af7651916cd43dd8448eb211c80319c"
    with OtlpSink() as sink:
        assert tracing.setup("pdserve-decode", sink.endpoint)
        try:
            asyncio.run(main())
        finally:
            tracing.shutdown()  # flushes
        spans = _trace(sink, trace_id, {"decode.generate", "decode.queue", "decode.prefill"})
    root = _one(spans, "decode.generate")
    assert root.parent_id == CLIENT_SPAN and root.attributes["pdserve.role"] == "colocated"
    assert root.attributes["pdserve.placement"] == "local"
    assert "colocated" in root.attributes["pdserve.placement.reason"]
    assert root.attributes["pdserve.generated_tokens"] == 3
    assert {"seat_granted", "first_token"} <= set(root.events)
    for name in ("decode.queue", "decode.prefill"):
        child = _one(spans, name)
        assert child.parent_id == root.span_id
        assert root.start_ns <= child.start_ns <= child.end_ns <= root.end_ns
