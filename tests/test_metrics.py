"""shared.serving.metrics: exposition, metric semantics, thread safety, the HTTP endpoint."""

from __future__ import annotations

import asyncio
import math
import re
import threading
from dataclasses import dataclass, field

import pytest

from shared.serving.metrics import (
    CONTENT_TYPE,
    MetricsRegistry,
    parse_prometheus_text,
    serve_metrics,
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
    reg = MetricsRegistry()
    c = reg.counter("pdserve_requests_total", "Requests finished.\nBy reason \\ role.", ["reason"])
    c.labels(reason="stop").inc()
    c.labels(reason="length").inc(3)
    c.labels("stop").inc(2)
    plain = reg.counter("pdserve_restarts_total", "Restarts.")
    g = reg.gauge("pdserve_queue_depth", "Queued requests.")
    g.set(7)
    g.dec(2)
    h = reg.histogram("pdserve_ttft_seconds", "TTFT.", [0.1, 1.0], ["role"])
    h.labels(role="decode").observe(0.05)
    reg.histogram("pdserve_unused_seconds", "Never observed.", [1.0])
    reg.counter("pdserve_empty_total", "Labelled, no children yet.", ["x"])

    text = reg.render()
    families = strict_parse(text)
    assert families["pdserve_requests_total"].type == "counter"
    assert families["pdserve_requests_total"].help == "Requests finished.\\nBy reason \\\\ role."
    assert families["pdserve_queue_depth"].type == "gauge"
    assert families["pdserve_ttft_seconds"].type == "histogram"
    assert families["pdserve_empty_total"].samples == []

    values = parse_prometheus_text(text)
    assert values['pdserve_requests_total{reason="stop"}'] == 3
    assert values['pdserve_requests_total{reason="length"}'] == 3
    assert values["pdserve_restarts_total"] == 0
    assert values["pdserve_queue_depth"] == 5
    assert values["pdserve_unused_seconds_count"] == 0
    assert values['pdserve_unused_seconds_bucket{le="+Inf"}'] == 0
    assert plain.value == 0 and g.value == 5


def test_histogram_buckets_are_cumulative() -> None:
    reg = MetricsRegistry()
    h = reg.histogram("lat_seconds", "Latency.", [0.01, 0.1, 1.0])
    for v in (0.001, 0.01, 0.05, 0.1, 0.5, 2.0, 100.0):
        h.observe(v)
    values = parse_prometheus_text(reg.render())
    # A value equal to a bound lands in that bucket (le = less or equal).
    assert values['lat_seconds_bucket{le="0.01"}'] == 2
    assert values['lat_seconds_bucket{le="0.1"}'] == 4
    assert values['lat_seconds_bucket{le="1.0"}'] == 5
    assert values['lat_seconds_bucket{le="+Inf"}'] == 7
    assert values["lat_seconds_count"] == 7
    assert values["lat_seconds_sum"] == pytest.approx(102.661)
    assert h.count == 7 and h.sum == pytest.approx(102.661)
    strict_parse(reg.render())


def test_histogram_rejects_bad_buckets_and_values() -> None:
    reg = MetricsRegistry()
    with pytest.raises(ValueError, match="increasing"):
        reg.histogram("a", "x", [1.0, 1.0])
    with pytest.raises(ValueError, match="le"):
        reg.histogram("b", "x", [1.0], ["le"])
    h = reg.histogram("c", "x", [1.0, math.inf])  # an explicit +Inf is not duplicated
    with pytest.raises(ValueError):
        h.observe(math.nan)
    assert parse_prometheus_text(reg.render())['c_bucket{le="+Inf"}'] == 0
    assert reg.render().count('le="+Inf"') == 1


def test_gauge_callbacks_are_sampled_at_scrape_time() -> None:
    reg = MetricsRegistry()
    state = {"seats": 2, "blocks": {("prefill", "gpu"): 10, ("decode", "gpu"): 4}}
    reg.gauge("seats_in_use", "Seats.", fn=lambda: state["seats"])
    reg.gauge("blocks_free", "Free blocks.", ["role", "pool"], fn=lambda: state["blocks"])
    reg.gauge("by_role", "Single label, str keys.", ["role"], fn=lambda: {"decode": 1.5})

    values = parse_prometheus_text(reg.render())
    assert values["seats_in_use"] == 2
    assert values['blocks_free{role="prefill",pool="gpu"}'] == 10
    assert values['blocks_free{role="decode",pool="gpu"}'] == 4
    assert values['by_role{role="decode"}'] == 1.5

    state["seats"] = 5
    state["blocks"] = {("decode", "gpu"): 0}
    values = parse_prometheus_text(reg.render())
    assert values["seats_in_use"] == 5
    assert 'blocks_free{role="prefill",pool="gpu"}' not in values
    assert values['blocks_free{role="decode",pool="gpu"}'] == 0
    strict_parse(reg.render())


def test_failing_callback_does_not_break_the_scrape(caplog: pytest.LogCaptureFixture) -> None:
    reg = MetricsRegistry()

    def broken() -> float:
        raise RuntimeError("manager gone")

    reg.gauge("broken", "Broken.", fn=broken)
    reg.gauge("wrong_arity", "Bad keys.", ["a", "b"], fn=lambda: {("x",): 1})
    reg.counter("fine_total", "Fine.").inc()
    text = reg.render()
    strict_parse(text)
    values = parse_prometheus_text(text)
    assert values == {"fine_total": 1}
    assert "manager gone" in caplog.text


def test_label_values_are_escaped_and_round_trip() -> None:
    reg = MetricsRegistry()
    c = reg.counter("odd_total", "Odd labels.", ["v"])
    nasty = 'a "quoted" \\ back\nslash,}{='
    c.labels(v=nasty).inc(2)
    c.labels(v="").inc()
    text = reg.render()
    assert 'odd_total{v="a \\"quoted\\" \\\\ back\\nslash,}{="} 2.0' in text
    families = strict_parse(text)
    assert [labels["v"] for _, labels, _ in families["odd_total"].samples] == [
        'a \\"quoted\\" \\\\ back\\nslash,}{=',
        "",
    ]
    values = parse_prometheus_text(text)
    assert values['odd_total{v="a \\"quoted\\" \\\\ back\\nslash,}{="}'] == 2
    assert values['odd_total{v=""}'] == 1


def test_misuse_is_rejected() -> None:
    reg = MetricsRegistry()
    c = reg.counter("c_total", "C.", ["a", "b"])
    with pytest.raises(ValueError):
        c.inc()  # labelled family needs .labels()
    with pytest.raises(ValueError):
        c.labels(a="1")
    with pytest.raises(ValueError):
        c.labels(a="1", b="2", z="3")
    with pytest.raises(ValueError):
        c.labels("1", b="2")
    with pytest.raises(ValueError):
        c.labels(a="1", b="2").inc(-1)
    with pytest.raises(ValueError, match="already registered"):
        reg.gauge("c_total", "dup")
    with pytest.raises(ValueError):
        reg.counter("bad-name", "x")
    with pytest.raises(ValueError):
        reg.counter("ok", "x", ["__reserved"])
    with pytest.raises(ValueError):
        reg.counter("ok2", "x", ["a", "a"])
    with pytest.raises(ValueError):
        reg.counter("plain", "x").labels(a="1")
    fn_gauge = reg.gauge("fn_gauge", "x", fn=lambda: 1.0)
    with pytest.raises(ValueError):
        fn_gauge.set(2)
    assert c.labels(a=1, b=2) is c.labels("1", "2")  # values are stringified


def test_concurrent_updates_are_not_lost() -> None:
    reg = MetricsRegistry()
    c = reg.counter("hits_total", "Hits.", ["t"])
    h = reg.histogram("obs", "Observations.", [0.5])
    g = reg.gauge("level", "Level.")
    n_threads, n_iter = 8, 5000

    def work(i: int) -> None:
        child = c.labels(t=str(i % 2))
        for k in range(n_iter):
            child.inc()
            h.observe(k % 2)
            g.inc()
            if k % 500 == 0:
                strict_parse(reg.render())  # scrapes interleaved with updates stay valid

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    values = parse_prometheus_text(reg.render())
    total = n_threads * n_iter
    assert values['hits_total{t="0"}'] + values['hits_total{t="1"}'] == total
    assert values["obs_count"] == total
    assert values['obs_bucket{le="0.5"}'] == total / 2
    assert values["obs_sum"] == total / 2
    assert values["level"] == total


def test_parse_prometheus_text() -> None:
    text = (
        "# HELP x X.\n# TYPE x gauge\n"
        'x{a="1",b="q\\"}"} 1.5 1700000000000\n'
        "y +Inf\n"
        "z NaN\n"
        "\n"
        "w -2e-3\n"
    )
    values = parse_prometheus_text(text)
    assert values['x{a="1",b="q\\"}"}'] == 1.5
    assert values["y"] == math.inf
    assert math.isnan(values["z"])
    assert values["w"] == -0.002
    with pytest.raises(ValueError, match="duplicate"):
        parse_prometheus_text("a 1\na 2\n")
    for bad in ("a", "a{b=1} 2", 'a{b="1" 2', "a 1 2 3", "a x", 'a{b="\\q"} 1', "1a 2"):
        with pytest.raises(ValueError):
            parse_prometheus_text(bad)


# --------------------------------------------------------------------------- HTTP endpoint


async def _http(port: int, raw: bytes, *, half_close: bool = False) -> tuple[int, dict, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        if half_close:
            writer.write_eof()
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout=5)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("ascii").split("\r\n")
    version, status, _ = status_line.split(" ", 2)
    assert version == "HTTP/1.1"
    headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
    if not raw.startswith(b"HEAD "):
        assert int(headers["content-length"]) == len(body)
    return int(status), headers, body


def _registry() -> MetricsRegistry:
    reg = MetricsRegistry()
    reg.counter("pdserve_scrapes_total", "Test counter.").inc(4)
    return reg


def test_http_endpoints() -> None:
    async def main() -> None:
        server = await serve_metrics(_registry(), "127.0.0.1", 0)
        try:
            assert server.port > 0
            status, headers, body = await _http(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")
            assert status == 200
            assert headers["content-type"] == CONTENT_TYPE
            strict_parse(body.decode())
            assert parse_prometheus_text(body.decode())["pdserve_scrapes_total"] == 4

            request = b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nAccept: */*\r\n\r\n"
            assert (await _http(server.port, request))[0] == 200
            # Bare-LF line endings (e.g. from netcat) are accepted too.
            assert (await _http(server.port, b"GET /healthz HTTP/1.0\n\n"))[0] == 200

            status, _, body = await _http(server.port, b"GET /healthz HTTP/1.1\r\n\r\n")
            assert (status, body) == (200, b"ok\n")
            status, headers, body = await _http(server.port, b"HEAD /healthz HTTP/1.1\r\n\r\n")
            # Content-Length describes the body a GET would get; none is sent.
            assert (status, headers["content-length"], body) == (200, "3", b"")
            assert (await _http(server.port, b"GET /nope HTTP/1.1\r\n\r\n"))[0] == 404
            assert (await _http(server.port, b"GET / HTTP/1.1\r\n\r\n"))[0] == 404
            assert (await _http(server.port, b"POST /metrics HTTP/1.1\r\n\r\n"))[0] == 405
        finally:
            await server.close()

    asyncio.run(main())


def test_http_malformed_and_oversized_requests() -> None:
    async def main() -> None:
        server = await serve_metrics(_registry(), "127.0.0.1", 0)
        try:
            for raw in (
                b"garbage\r\n\r\n",
                b"GET /metrics\r\n\r\n",
                b"GET /metrics SPDY/3\r\n\r\n",
                b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
                b"\xff\xfe /metrics HTTP/1.1\r\n\r\n",
            ):
                assert (await _http(server.port, raw))[0] == 400, raw
            # EOF in the middle of the head.
            status, _, _ = await _http(server.port, b"GET /metrics HTTP/1.1\r\n", half_close=True)
            assert status == 400
            huge_line = b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n"
            assert (await _http(server.port, huge_line))[0] == 431
            many_headers = b"GET /metrics HTTP/1.1\r\n" + b"X-A: b\r\n" * 2000 + b"\r\n"
            assert (await _http(server.port, many_headers))[0] == 431
            # The server is still healthy afterwards.
            assert (await _http(server.port, b"GET /healthz HTTP/1.1\r\n\r\n"))[0] == 200
        finally:
            await server.close()

    asyncio.run(main())


def test_http_slow_client_times_out_without_blocking_others() -> None:
    async def main() -> None:
        server = await serve_metrics(_registry(), "127.0.0.1", 0, io_timeout=0.3)
        try:
            loop = asyncio.get_running_loop()
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /metr")  # ...and then nothing more
            await writer.drain()
            # Other clients are served while the slow one dawdles.
            assert (await _http(server.port, b"GET /healthz HTTP/1.1\r\n\r\n"))[0] == 200
            start = loop.time()
            data = await asyncio.wait_for(reader.read(), timeout=5)
            assert data.startswith(b"HTTP/1.1 408 ")
            assert loop.time() - start < 2
            writer.close()
        finally:
            await server.close()

    asyncio.run(main())


def test_http_close_drops_idle_connections_and_stops_listening() -> None:
    async def main() -> None:
        server = await serve_metrics(_registry(), "127.0.0.1", 0, io_timeout=60)
        port = server.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.05)  # let the server accept it
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.wait_for(server.close(), timeout=5)
        assert loop.time() - start < 2, "close() waited for an idle client"
        assert await asyncio.wait_for(reader.read(), timeout=5) == b""
        writer.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        await server.close()  # idempotent

    asyncio.run(main())
