"""shared.serving.metrics: node metrics on prometheus_client, scrape-time collectors, and the
uvicorn-served /metrics + /health endpoint."""

from __future__ import annotations

import asyncio
import math
import re
import threading
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from shared.engine.runtime import cpu_threads
from shared.engine.thread import EngineSnapshot
from shared.serving.grpc_server import NodeMetrics
from shared.serving.metrics import (
    CONTENT_TYPE,
    AsgiServer,
    metrics_app,
    parse_prometheus_text,
    register_scrape_counter,
    register_scrape_gauge,
    render,
)

# --------------------------------------------------------------------------- strict validator

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_VALUE = r"(?:[+-]?Inf|NaN|[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
_HELP_RE = re.compile(rf"# HELP ({_NAME}) ((?:[^\\\n]|\\[\\n])*)")
_TYPE_RE = re.compile(rf"# TYPE ({_NAME}) (counter|gauge|histogram|summary|untyped)")
_SAMPLE_RE = re.compile(rf"({_NAME})(\{{(?:{_LABEL}(?:,{_LABEL})*)?\}})? ({_VALUE})(?: (-?\d+))?")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


@dataclass
class _Family:
    type: str = "untyped"
    help: str | None = None
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


_SPECIAL_FLOATS = {"+Inf": math.inf, "Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}


def _go_float(token: str) -> float:
    return _SPECIAL_FLOATS[token] if token in _SPECIAL_FLOATS else float(token)


def strict_parse(text: str) -> dict[str, _Family]:
    """Validate text exposition format 0.0.4 strictly; return families by name.

    Checks: every line matches the grammar exactly (single spaces, valid escapes), text ends with
    a newline, HELP/TYPE at most once per family and before its samples, a family's samples are
    contiguous, no duplicate series, and histograms are well formed (sorted le, cumulative
    buckets, +Inf bucket equal to _count, _sum and _count present).
    """
    assert text.endswith("\n"), "exposition must end with a newline"
    families: dict[str, _Family] = {}
    seen_series: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    finished: set[str] = set()
    current: str | None = None

    def family_of(sample_name: str) -> str:
        for suffix in ("_bucket", "_sum", "_count"):
            base = sample_name.removesuffix(suffix)
            if base != sample_name and families.get(base, _Family()).type == "histogram":
                return base
        return sample_name

    def enter(name: str) -> None:
        nonlocal current
        if current != name:
            assert name not in finished, f"samples of {name} are not contiguous"
            if current is not None:
                finished.add(current)
            current = name

    for line in text.splitlines():
        assert line, "blank lines are not produced by a well-behaved exporter"
        if line.startswith("# HELP "):
            m = _HELP_RE.fullmatch(line)
            assert m, f"bad HELP line {line!r}"
            fam = families.setdefault(m.group(1), _Family())
            assert fam.help is None, f"second HELP for {m.group(1)}"
            assert not fam.samples, f"HELP after samples for {m.group(1)}"
            fam.help = m.group(2)
            enter(m.group(1))
        elif line.startswith("# TYPE "):
            m = _TYPE_RE.fullmatch(line)
            assert m, f"bad TYPE line {line!r}"
            fam = families.setdefault(m.group(1), _Family())
            assert not fam.samples, f"TYPE after samples for {m.group(1)}"
            fam.type = m.group(2)
            enter(m.group(1))
        elif line.startswith("#"):
            continue
        else:
            m = _SAMPLE_RE.fullmatch(line)
            assert m, f"bad sample line {line!r}"
            name, labels_text, value = m.group(1), m.group(2) or "", m.group(3)
            pairs = _LABEL_RE.findall(labels_text)
            labels = dict(pairs)
            assert len(labels) == len(pairs), f"duplicate label in {line!r}"
            series = (name, tuple(sorted(labels.items())))
            assert series not in seen_series, f"duplicate series {line!r}"
            seen_series.add(series)
            base = family_of(name)
            enter(base)
            families.setdefault(base, _Family()).samples.append((name, labels, _go_float(value)))

    for base, fam in families.items():
        if fam.type == "histogram":
            _check_histogram(base, fam)
    return families


def _check_histogram(base: str, fam: _Family) -> None:
    groups: dict[tuple[tuple[str, str], ...], dict[str, list[tuple[float, float]]]] = {}
    for name, labels, value in fam.samples:
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        group = groups.setdefault(key, {"bucket": [], "sum": [], "count": []})
        suffix = name.removeprefix(base + "_")
        assert suffix in group, f"unexpected sample {name} in histogram {base}"
        le = _go_float(labels["le"]) if suffix == "bucket" else 0.0
        if suffix != "bucket":
            assert "le" not in labels
        group[suffix].append((le, value))
    for key, group in groups.items():
        buckets = group["bucket"]
        assert buckets and buckets[-1][0] == math.inf, f"{base}{key}: no +Inf bucket"
        bounds = [b for b, _ in buckets]
        assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds), bounds
        counts = [c for _, c in buckets]
        assert counts == sorted(counts), f"{base}{key}: buckets not cumulative {counts}"
        assert len(group["count"]) == 1 and len(group["sum"]) == 1, f"{base}{key}"
        assert group["count"][0][1] == buckets[-1][1], f"{base}{key}: +Inf != _count"


@pytest.mark.parametrize(
    "bad",
    [
        "x 1",  # no trailing newline
        "x  1\n",  # double space
        'x{a="1",} 1\n',  # trailing comma (valid in some parsers, never produced here)
        'x{a="1",a="2"} 1\n',
        "x 1\nx 2\n",
        'x{a="\\q"} 1\n',
        "x one\n",
        "# TYPE x gauge\nx 1\n# TYPE x gauge\n",
        "x 1\n# HELP x late\n",
        'x 1\ny 1\nx{a="b"} 1\n',  # not contiguous
        '# TYPE h histogram\nh_bucket{le="1.0"} 2\nh_bucket{le="+Inf"} 1\nh_sum 0\nh_count 1\n',
        '# TYPE h histogram\nh_bucket{le="1.0"} 1\nh_sum 0\nh_count 1\n',
        '# TYPE h histogram\nh_bucket{le="+Inf"} 2\nh_sum 0\nh_count 1\n',
    ],
)
def test_strict_validator_rejects_bad_text(bad: str) -> None:
    # The validator is what the other tests lean on, so check it has teeth.
    with pytest.raises(AssertionError):
        strict_parse(bad)


# --------------------------------------------------------------------------- registry


def test_exposition_format_is_strictly_valid() -> None:
    reg = CollectorRegistry()
    c = Counter(
        "pdserve_requests_total", "Requests finished.\nBy reason \\ role.", ["reason"], registry=reg
    )
    c.labels(reason="stop").inc()
    c.labels(reason="length").inc(3)
    c.labels("stop").inc(2)
    Counter("pdserve_restarts_total", "Restarts.", registry=reg)
    g = Gauge("pdserve_queue_depth", "Queued requests.", registry=reg)
    g.set(7)
    g.dec(2)
    h = Histogram("pdserve_ttft_seconds", "TTFT.", ["role"], buckets=[0.1, 1.0], registry=reg)
    h.labels(role="decode").observe(0.05)
    Histogram("pdserve_unused_seconds", "Never observed.", buckets=[1.0], registry=reg)
    Counter("pdserve_empty_total", "Labelled, no children yet.", ["x"], registry=reg)
    register_scrape_gauge(reg, "pdserve_seats", "Seats.", lambda: 3)

    text = render(reg)
    families = strict_parse(text)
    assert families["pdserve_requests_total"].type == "counter"
    assert families["pdserve_requests_total"].help == "Requests finished.\\nBy reason \\\\ role."
    assert families["pdserve_queue_depth"].type == "gauge"
    assert families["pdserve_ttft_seconds"].type == "histogram"
    assert families["pdserve_empty_total"].samples == []
    assert "_created" not in text  # no extra series beside the ones pdserve always had

    values = parse_prometheus_text(text)
    assert values['pdserve_requests_total{reason="stop"}'] == 3
    assert values['pdserve_requests_total{reason="length"}'] == 3
    assert values["pdserve_restarts_total"] == 0
    assert values["pdserve_queue_depth"] == 5
    assert values["pdserve_seats"] == 3
    assert values["pdserve_unused_seconds_count"] == 0
    assert values['pdserve_unused_seconds_bucket{le="+Inf"}'] == 0


def test_histogram_buckets_are_cumulative() -> None:
    reg = CollectorRegistry()
    h = Histogram("lat_seconds", "Latency.", buckets=[0.01, 0.1, 1.0], registry=reg)
    for v in (0.001, 0.01, 0.05, 0.1, 0.5, 2.0, 100.0):
        h.observe(v)
    values = parse_prometheus_text(render(reg))
    # A value equal to a bound lands in that bucket (le = less or equal).
    assert values['lat_seconds_bucket{le="0.01"}'] == 2
    assert values['lat_seconds_bucket{le="0.1"}'] == 4
    assert values['lat_seconds_bucket{le="1.0"}'] == 5
    assert values['lat_seconds_bucket{le="+Inf"}'] == 7
    assert values["lat_seconds_count"] == 7
    assert values["lat_seconds_sum"] == pytest.approx(102.661)
    strict_parse(render(reg))


def test_scrape_collectors_are_sampled_at_scrape_time() -> None:
    reg = CollectorRegistry()
    state = {"seats": 2, "blocks": {("prefill", "gpu"): 10, ("decode", "gpu"): 4}, "rej": 0}
    register_scrape_gauge(reg, "seq_slots_in_use", "Seats.", lambda: state["seats"])
    register_scrape_gauge(
        reg, "blocks_free", "Free blocks.", lambda: state["blocks"], labelnames=["role", "pool"]
    )
    register_scrape_gauge(reg, "by_role", "Str keys.", lambda: {"decode": 1.5}, labelnames=["r"])
    register_scrape_counter(reg, "rejected_total", "Rejected.", lambda: state["rej"])

    values = parse_prometheus_text(render(reg))
    assert values["seq_slots_in_use"] == 2
    assert values['blocks_free{pool="gpu",role="prefill"}'] == 10
    assert values['blocks_free{pool="gpu",role="decode"}'] == 4
    assert values['by_role{r="decode"}'] == 1.5
    assert values["rejected_total"] == 0

    state.update(seats=5, blocks={("decode", "gpu"): 0}, rej=7)
    text = render(reg)
    values = parse_prometheus_text(text)
    assert values["seq_slots_in_use"] == 5
    assert 'blocks_free{pool="gpu",role="prefill"}' not in values
    assert values['blocks_free{pool="gpu",role="decode"}'] == 0
    assert values["rejected_total"] == 7
    families = strict_parse(text)
    assert families["rejected_total"].type == "counter"


def test_failing_callback_does_not_break_the_scrape(caplog: pytest.LogCaptureFixture) -> None:
    reg = CollectorRegistry()

    def broken() -> float:
        raise RuntimeError("manager gone")

    register_scrape_gauge(reg, "broken", "Broken.", broken)
    register_scrape_gauge(reg, "wrong_arity", "Bad keys.", lambda: {("x",): 1}, ["a", "b"])
    register_scrape_gauge(reg, "not_a_dict", "Labelled.", lambda: 1.0, ["a"])
    Counter("fine_total", "Fine.", registry=reg).inc()
    text = render(reg)
    strict_parse(text)
    assert parse_prometheus_text(text) == {"fine_total": 1}
    assert "manager gone" in caplog.text


def test_label_values_are_escaped_and_round_trip() -> None:
    reg = CollectorRegistry()
    c = Counter("odd_total", "Odd labels.", ["v"], registry=reg)
    nasty = 'a "quoted" \\ back\nslash,}{='
    c.labels(v=nasty).inc(2)
    c.labels(v="").inc()
    text = render(reg)
    assert 'odd_total{v="a \\"quoted\\" \\\\ back\\nslash,}{="} 2.0' in text
    strict_parse(text)
    labels = [s.labels["v"] for f in text_string_to_metric_families(text) for s in f.samples]
    assert labels == [nasty, ""]
    values = parse_prometheus_text(text)
    assert values['odd_total{v="a \\"quoted\\" \\\\ back\\nslash,}{="}'] == 2
    assert values['odd_total{v=""}'] == 1


def test_node_metrics_keep_their_names() -> None:
    """Every name and label dashboards and tests read, exactly as before the move."""
    snap = EngineSnapshot(
        seq_slots_in_use=1,
        seq_slots_total=8,
        blocks_in_use=3,
        blocks_total=64,
        blocks_pinned=2,
        blocks_cached=1,
        requests_by_state={"GENERATION_IN_PROGRESS": 1},
    )
    m = NodeMetrics(lambda: snap, rejected=lambda: 4)
    m.ttft.observe(0.01)
    m.itl.observe(0.001)
    m.kv_transfer_seconds.observe(0.2)
    m.kv_transfer_bytes.inc(1024)
    m.requests_total.labels(outcome="stop").inc()
    text = render(m.registry)
    families = strict_parse(text)
    values = parse_prometheus_text(text)
    assert values["pdserve_seats_in_use"] == 1 and values["pdserve_seats_total"] == 8
    assert values["pdserve_kv_blocks_in_use"] == 3 and values["pdserve_kv_blocks_total"] == 64
    assert values["pdserve_kv_blocks_pinned"] == 2 and values["pdserve_kv_blocks_cached"] == 1
    assert values['pdserve_requests{state="GENERATION_IN_PROGRESS"}'] == 1
    assert values["pdserve_kv_transfer_bytes_total"] == 1024
    assert values["pdserve_kv_transfer_rejected_total"] == 4
    assert values['pdserve_requests_total{outcome="stop"}'] == 1
    assert values["pdserve_cpu_threads"] == cpu_threads.current() >= 1
    for name in (
        "pdserve_time_to_first_token_seconds",
        "pdserve_inter_token_latency_seconds",
        "pdserve_kv_transfer_seconds",
    ):
        assert families[name].type == "histogram"
        assert values[f"{name}_count"] == 1
        assert values[f'{name}_bucket{{le="0.0005"}}'] in (0, 1)


def test_concurrent_updates_are_not_lost() -> None:
    reg = CollectorRegistry()
    c = Counter("hits_total", "Hits.", ["t"], registry=reg)
    h = Histogram("obs", "Observations.", buckets=[0.5], registry=reg)
    n_threads, n_iter = 8, 2000

    def work(i: int) -> None:
        child = c.labels(t=str(i % 2))
        for k in range(n_iter):
            child.inc()
            h.observe(k % 2)
            if k % 500 == 0:
                strict_parse(render(reg))  # scrapes interleaved with updates stay valid

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    values = parse_prometheus_text(render(reg))
    total = n_threads * n_iter
    assert values['hits_total{t="0"}'] + values['hits_total{t="1"}'] == total
    assert values["obs_count"] == total
    assert values['obs_bucket{le="0.5"}'] == total / 2


def test_parse_prometheus_text_rejects_duplicates() -> None:
    values = parse_prometheus_text('# TYPE x gauge\nx{a="1",b="q\\"}"} 1.5\ny +Inf\n')
    assert values['x{a="1",b="q\\"}"}'] == 1.5
    assert values["y"] == math.inf
    with pytest.raises(ValueError, match="duplicate"):
        parse_prometheus_text("a 1\na 2\n")


# --------------------------------------------------------------------------- HTTP endpoint


def _registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("pdserve_scrapes_total", "Test counter.", registry=reg).inc(4)
    return reg


def test_http_endpoints_on_uvicorn() -> None:
    state = {"healthy": True}

    async def main() -> None:
        app = metrics_app(_registry(), lambda: state["healthy"])
        server = await AsgiServer.start(app, "127.0.0.1", 0)
        try:
            assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
            async with httpx.AsyncClient(base_url=server.url) as client:
                resp = await client.get("/metrics")
                assert resp.status_code == 200
                assert resp.headers["content-type"] == CONTENT_TYPE
                strict_parse(resp.text)
                assert parse_prometheus_text(resp.text)["pdserve_scrapes_total"] == 4
                assert (await client.get("/metrics?x=1")).status_code == 200
                assert (await client.get("/health")).status_code == 200
                assert (await client.get("/healthz")).text == "ok\n"
                assert (await client.head("/health")).status_code == 200
                assert (await client.get("/nope")).status_code == 404
                assert (await client.post("/metrics")).status_code == 405
                state["healthy"] = False
                resp = await client.get("/health")
                assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        finally:
            await server.close()

    asyncio.run(main())


def test_http_malformed_requests_leave_the_server_serving() -> None:
    async def main() -> None:
        server = await AsgiServer.start(metrics_app(_registry(), lambda: True), "127.0.0.1", 0)
        try:
            for raw in (b"garbage\r\n\r\n", b"GET /metrics SPDY/3\r\n\r\n"):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(raw)
                await writer.drain()
                data = await asyncio.wait_for(reader.read(), timeout=5)
                writer.close()
                assert data.startswith(b"HTTP/1.1 400"), data
            async with httpx.AsyncClient(base_url=server.url) as client:
                assert (await client.get("/health")).status_code == 200
        finally:
            await server.close()

    asyncio.run(main())


def test_http_close_stops_listening_and_is_idempotent() -> None:
    async def main() -> None:
        server = await AsgiServer.start(metrics_app(_registry(), lambda: True), "127.0.0.1", 0)
        port = server.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.wait_for(server.close(), timeout=10)
        assert await asyncio.wait_for(reader.read(), timeout=5) == b""
        writer.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        await server.close()

    asyncio.run(main())


def test_http_bind_failure_raises() -> None:
    async def main() -> None:
        server = await AsgiServer.start(metrics_app(_registry(), lambda: True), "127.0.0.1", 0)
        try:
            with pytest.raises(OSError):
                await AsgiServer.start(
                    metrics_app(_registry(), lambda: True), "127.0.0.1", server.port
                )
        finally:
            await server.close()

    asyncio.run(main())
