"""A small, dependency-free Prometheus registry and /metrics endpoint.

Why not prometheus_client: pdserve needs only counters, gauges and histograms, some gauges read at
scrape time from live managers, and an endpoint that lives on the node's asyncio loop. This module
renders text exposition format 0.0.4 and is thread-safe: observations arrive from the compute
thread and the event loop at once.

Usage::

    registry = MetricsRegistry()
    requests = registry.counter("pdserve_requests_total", "Requests finished.", ["reason"])
    requests.labels(reason="stop").inc()
    registry.gauge("pdserve_seats_in_use", "Busy seats.", fn=lambda: manager.seats_in_use)
    ttft = registry.histogram("pdserve_ttft_seconds", "Time to first token.", LATENCY_BUCKETS)
    ttft.observe(0.042)
    server = await serve_metrics(registry, "0.0.0.0", 9100)
    ...
    await server.close()

Tests read values back with `parse_prometheus_text(registry.render())`.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import math
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import ClassVar, Generic, TypeVar

__all__ = [
    "CONTENT_TYPE",
    "LATENCY_BUCKETS",
    "Counter",
    "Gauge",
    "Histogram",
    "MetricsRegistry",
    "MetricsServer",
    "parse_prometheus_text",
    "serve_metrics",
]

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; spans sub-millisecond steps up to minute-long requests.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
)  # fmt: skip

_METRIC_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_SAMPLE_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_START_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"')
_LABEL_SEP_RE = re.compile(r"\s*(,?)\s*")

LabelValues = tuple[str, ...]
GaugeCallback = Callable[[], "float | Mapping[LabelValues | str, float]"]


# --------------------------------------------------------------------------- formatting


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    # repr round-trips exactly and its forms (1.0, 0.005, 1e-05) are all valid Go floats.
    return repr(float(value))


def _escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _format_labels(pairs: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_escape_label_value(v)}"' for k, v in pairs)
    return f"{{{inner}}}" if inner else ""


# --------------------------------------------------------------------------- metric types


class _Child:
    """State of one label combination; shares its family's lock."""

    __slots__ = ("_lock",)

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock


class _CounterChild(_Child):
    __slots__ = ("_value",)

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self._value = 0.0

    def inc(self, v: float = 1.0) -> None:
        if not v >= 0:  # also rejects NaN
            raise ValueError(f"counters only go up; inc({v!r})")
        with self._lock:
            self._value += v

    @property
    def value(self) -> float:
        with self._lock:
            return self._value


class _GaugeChild(_Child):
    __slots__ = ("_value",)

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self._value = 0.0

    def set(self, v: float) -> None:
        with self._lock:
            self._value = float(v)

    def inc(self, v: float = 1.0) -> None:
        with self._lock:
            self._value += v

    def dec(self, v: float = 1.0) -> None:
        with self._lock:
            self._value -= v

    @property
    def value(self) -> float:
        with self._lock:
            return self._value


class _HistogramChild(_Child):
    __slots__ = ("_count", "_counts", "_sum", "_upper_bounds")

    def __init__(self, lock: threading.Lock, upper_bounds: tuple[float, ...]) -> None:
        super().__init__(lock)
        self._upper_bounds = upper_bounds  # ends with +Inf
        self._counts = [0] * len(upper_bounds)  # per bucket, not cumulative
        self._count = 0
        self._sum = 0.0

    def observe(self, v: float) -> None:
        if math.isnan(v):
            raise ValueError("cannot observe NaN")
        # bisect_left: a value equal to a bound belongs to that bucket (le = "less or equal").
        index = bisect.bisect_left(self._upper_bounds, v)
        with self._lock:
            self._counts[index] += 1
            self._count += 1
            self._sum += v

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    @property
    def sum(self) -> float:
        with self._lock:
            return self._sum

    def snapshot(self) -> tuple[list[int], int, float]:
        """(cumulative bucket counts, count, sum), read consistently."""
        with self._lock:
            counts, count, total = list(self._counts), self._count, self._sum
        cumulative: list[int] = []
        running = 0
        for c in counts:
            running += c
            cumulative.append(running)
        return cumulative, count, total


ChildT = TypeVar("ChildT", bound=_Child)


class _Family(Generic[ChildT]):
    """A named metric with fixed label names; unlabelled metrics act as their only child."""

    type_name: ClassVar[str]

    def __init__(self, name: str, help: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.help = help
        self.labelnames: tuple[str, ...] = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: dict[LabelValues, ChildT] = {}
        self._root: ChildT | None = None if self.labelnames else self._make_child()

    def _make_child(self) -> ChildT:
        raise NotImplementedError

    def labels(self, *values: object, **kv: object) -> ChildT:
        """The child for one label combination, created on first use.

        Pass label values positionally (in labelnames order) or by name, not both.
        """
        if not self.labelnames:
            raise ValueError(f"{self.name} has no labels")
        if values and kv:
            raise ValueError("pass label values positionally or by name, not both")
        if kv:
            if set(kv) != set(self.labelnames):
                raise ValueError(
                    f"{self.name} takes labels {list(self.labelnames)}, got {sorted(kv)}"
                )
            values = tuple(kv[name] for name in self.labelnames)
        if len(values) != len(self.labelnames):
            raise ValueError(
                f"{self.name} takes {len(self.labelnames)} label values, got {len(values)}"
            )
        key = tuple(str(v) for v in values)
        child = self._children.get(key)  # lock-free fast path: dict reads are atomic
        if child is None:
            with self._lock:
                child = self._children.get(key)
                if child is None:
                    child = self._make_child()
                    self._children[key] = child
        return child

    def _unlabelled(self) -> ChildT:
        if self._root is None:
            raise ValueError(f"{self.name} has labels {list(self.labelnames)}; use .labels()")
        return self._root

    def _items(self) -> list[tuple[LabelValues, ChildT]]:
        if self._root is not None:
            return [((), self._root)]
        with self._lock:
            return list(self._children.items())

    def _label_pairs(self, values: LabelValues) -> list[tuple[str, str]]:
        return list(zip(self.labelnames, values, strict=True))

    def _samples(self) -> Iterator[str]:
        raise NotImplementedError

    def render(self) -> str:
        lines = [
            f"# HELP {self.name} {_escape_help(self.help)}",
            f"# TYPE {self.name} {self.type_name}",
        ]
        lines.extend(self._samples())
        return "\n".join(lines) + "\n"


class Counter(_Family[_CounterChild]):
    type_name = "counter"

    def _make_child(self) -> _CounterChild:
        return _CounterChild(self._lock)

    def inc(self, v: float = 1.0) -> None:
        self._unlabelled().inc(v)

    @property
    def value(self) -> float:
        return self._unlabelled().value

    def _samples(self) -> Iterator[str]:
        for values, child in self._items():
            labels = _format_labels(self._label_pairs(values))
            yield f"{self.name}{labels} {_format_value(child.value)}"


class Gauge(_Family[_GaugeChild]):
    """A gauge that is either set by the caller or, with `fn`, sampled at scrape time.

    For a labelled gauge, `fn` returns {label values tuple: value}; a bare string key is accepted
    for single-label gauges.
    """

    type_name = "gauge"

    def __init__(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str],
        fn: GaugeCallback | None = None,
    ) -> None:
        super().__init__(name, help, labelnames)
        self.fn = fn

    def _make_child(self) -> _GaugeChild:
        return _GaugeChild(self._lock)

    def labels(self, *values: object, **kv: object) -> _GaugeChild:
        if self.fn is not None:
            raise ValueError(f"{self.name} is computed by a callback; it cannot be set")
        return super().labels(*values, **kv)

    def _settable(self) -> _GaugeChild:
        if self.fn is not None:
            raise ValueError(f"{self.name} is computed by a callback; it cannot be set")
        return self._unlabelled()

    def set(self, v: float) -> None:
        self._settable().set(v)

    def inc(self, v: float = 1.0) -> None:
        self._settable().inc(v)

    def dec(self, v: float = 1.0) -> None:
        self._settable().dec(v)

    @property
    def value(self) -> float:
        return self._settable().value

    def _callback_items(self) -> list[tuple[LabelValues, float]]:
        assert self.fn is not None
        result = self.fn()
        if not self.labelnames:
            if isinstance(result, Mapping):
                raise TypeError(f"{self.name} has no labels; its callback must return a number")
            return [((), float(result))]
        if not isinstance(result, Mapping):
            raise TypeError(f"{self.name} is labelled; its callback must return a dict")
        items: list[tuple[LabelValues, float]] = []
        for key, value in result.items():
            values = (key,) if isinstance(key, str) else tuple(str(k) for k in key)
            if len(values) != len(self.labelnames):
                raise ValueError(
                    f"{self.name} callback key {key!r} does not match labels "
                    f"{list(self.labelnames)}"
                )
            items.append((values, float(value)))
        return items

    def _samples(self) -> Iterator[str]:
        if self.fn is None:
            items = [(values, child.value) for values, child in self._items()]
        else:
            try:
                items = self._callback_items()
            except Exception:
                # One broken callback must not take the whole scrape down with it.
                logger.exception("metrics callback for %s failed; omitting it", self.name)
                return
        for values, value in items:
            labels = _format_labels(self._label_pairs(values))
            yield f"{self.name}{labels} {_format_value(value)}"


class CallbackCounter(Gauge):
    """A counter whose value is read at scrape time from a monotonic source the owner keeps
    (e.g. the KV receiver's rejected-message count), so hot paths need no registry access."""

    type_name = "counter"


class Histogram(_Family[_HistogramChild]):
    type_name = "histogram"

    def __init__(
        self, name: str, help: str, buckets: Sequence[float], labelnames: Sequence[str]
    ) -> None:
        bounds = [float(b) for b in buckets]
        if any(math.isnan(b) for b in bounds):
            raise ValueError("histogram buckets cannot be NaN")
        if any(b >= c for b, c in itertools.pairwise(bounds)):
            raise ValueError(f"histogram buckets must be strictly increasing, got {list(buckets)}")
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        if "le" in labelnames:
            raise ValueError("histograms cannot use the label name 'le'")
        self.upper_bounds: tuple[float, ...] = tuple(bounds)
        super().__init__(name, help, labelnames)

    def _make_child(self) -> _HistogramChild:
        return _HistogramChild(self._lock, self.upper_bounds)

    def observe(self, v: float) -> None:
        self._unlabelled().observe(v)

    @property
    def count(self) -> int:
        return self._unlabelled().count

    @property
    def sum(self) -> float:
        return self._unlabelled().sum

    def _samples(self) -> Iterator[str]:
        for values, child in self._items():
            pairs = self._label_pairs(values)
            cumulative, count, total = child.snapshot()
            for bound, n in zip(self.upper_bounds, cumulative, strict=True):
                labels = _format_labels([*pairs, ("le", _format_value(bound))])
                yield f"{self.name}_bucket{labels} {n}"
            labels = _format_labels(pairs)
            yield f"{self.name}_sum{labels} {_format_value(total)}"
            yield f"{self.name}_count{labels} {count}"


# --------------------------------------------------------------------------- registry


class MetricsRegistry:
    """Holds metric families in registration order and renders them for a scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, Counter | Gauge | Histogram] = {}

    def _register(self, family: Counter | Gauge | Histogram) -> None:
        if not _METRIC_NAME_RE.match(family.name):
            raise ValueError(f"invalid metric name {family.name!r}")
        for label in family.labelnames:
            if not _LABEL_NAME_RE.match(label) or label.startswith("__"):
                raise ValueError(f"invalid label name {label!r} for {family.name}")
        if len(set(family.labelnames)) != len(family.labelnames):
            raise ValueError(f"duplicate label names for {family.name}: {family.labelnames}")
        with self._lock:
            if family.name in self._families:
                raise ValueError(f"metric {family.name!r} is already registered")
            self._families[family.name] = family

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        family = Counter(name, help, labelnames)
        self._register(family)
        return family

    def callback_counter(self, name: str, help: str, fn: GaugeCallback) -> CallbackCounter:
        family = CallbackCounter(name, help, (), fn)
        self._register(family)
        return family

    def gauge(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str] = (),
        fn: GaugeCallback | None = None,
    ) -> Gauge:
        family = Gauge(name, help, labelnames, fn)
        self._register(family)
        return family

    def histogram(
        self,
        name: str,
        help: str,
        buckets: Sequence[float] = LATENCY_BUCKETS,
        labelnames: Sequence[str] = (),
    ) -> Histogram:
        family = Histogram(name, help, buckets, labelnames)
        self._register(family)
        return family

    def get(self, name: str) -> Counter | Gauge | Histogram:
        with self._lock:
            return self._families[name]

    def render(self) -> str:
        """The whole registry in Prometheus text exposition format 0.0.4."""
        with self._lock:
            families = list(self._families.values())
        # Families render outside the registry lock: gauge callbacks may take other locks.
        return "".join(family.render() for family in families)


# --------------------------------------------------------------------------- parsing (for tests)


def _parse_labels(text: str, pos: int, line: str) -> tuple[list[tuple[str, str]], int]:
    """Parse `{a="b",...}` starting at text[pos] == "{"; return (pairs, index after "}")."""
    pairs: list[tuple[str, str]] = []
    pos += 1
    while True:
        if text.startswith("}", pos):
            return pairs, pos + 1
        match = _LABEL_START_RE.match(text, pos)
        if match is None:
            raise ValueError(f"bad label syntax in {line!r}")
        name = match.group(1)
        pos = match.end()
        chars: list[str] = []
        while True:
            if pos >= len(text):
                raise ValueError(f"unterminated label value in {line!r}")
            c = text[pos]
            if c == "\\":
                escaped = text[pos + 1 : pos + 2]
                if escaped == "n":
                    chars.append("\n")
                elif escaped in ('"', "\\"):
                    chars.append(escaped)
                else:
                    raise ValueError(f"bad escape in label value in {line!r}")
                pos += 2
            elif c == '"':
                pos += 1
                break
            else:
                chars.append(c)
                pos += 1
        pairs.append((name, "".join(chars)))
        rest = _LABEL_SEP_RE.match(text, pos)
        assert rest is not None  # the pattern matches the empty string
        pos = rest.end()
        if not rest.group(1) and not text.startswith("}", pos):
            raise ValueError(f"expected ',' or '}}' in labels of {line!r}")


def _parse_value(token: str, line: str) -> float:
    special = {"+Inf": math.inf, "-Inf": -math.inf, "Inf": math.inf, "NaN": math.nan}
    if token in special:
        return special[token]
    try:
        return float(token)
    except ValueError:
        raise ValueError(f"bad sample value {token!r} in {line!r}") from None


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Parse exposition text into {key: value}; comments and blank lines are skipped.

    Keys look like `name` or `name{a="b",c="d"}`: labels in the order they appear in the text
    (for metrics from this module, their labelnames order, with `le` last), values escaped as in
    the exposition format, no spaces. Histogram bounds appear as rendered, e.g. `le="0.5"`,
    `le="1.0"`, `le="+Inf"`. Raises ValueError on malformed lines or duplicate samples.
    """
    samples: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_NAME_RE.match(line)
        if match is None:
            raise ValueError(f"bad metric name in {raw!r}")
        name, pos = match.group(0), match.end()
        pairs: list[tuple[str, str]] = []
        if line.startswith("{", pos):
            pairs, pos = _parse_labels(line, pos, raw)
        fields = line[pos:].split()
        if not line[pos : pos + 1].isspace() or len(fields) not in (1, 2):
            raise ValueError(f"expected 'value [timestamp]' after the name in {raw!r}")
        key = name + _format_labels(pairs)
        if key in samples:
            raise ValueError(f"duplicate sample {key}")
        samples[key] = _parse_value(fields[0], raw)
    return samples


# --------------------------------------------------------------------------- HTTP endpoint

_MAX_HEAD_BYTES = 8192
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
}


class _BadRequest(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class MetricsServer:
    """A minimal HTTP/1.1 server: GET /metrics, GET /healthz. One request per connection."""

    def __init__(self, registry: MetricsRegistry, *, io_timeout: float) -> None:
        self._registry = registry
        self._io_timeout = io_timeout
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.host = ""
        self.port = 0

    async def _start(self, host: str, port: int) -> None:
        # limit caps a single line; _read_head caps the whole head.
        self._server = await asyncio.start_server(self._handle, host, port, limit=_MAX_HEAD_BYTES)
        sockname = self._server.sockets[0].getsockname()
        self.host, self.port = sockname[0], sockname[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def _read_head(self, reader: asyncio.StreamReader) -> tuple[str, str]:
        """Read the request line and headers; return (method, path without query)."""
        total = 0
        lines: list[bytes] = []
        while True:
            try:
                line = await reader.readline()
            except ValueError:  # a single line longer than the stream limit
                raise _BadRequest(431) from None
            total += len(line)
            if total > _MAX_HEAD_BYTES:
                raise _BadRequest(431)
            if not line.endswith(b"\n"):  # EOF before the head ended
                raise _BadRequest(400)
            if line in (b"\r\n", b"\n"):
                if not lines:
                    continue  # RFC 9112: tolerate empty lines before the request line
                break
            lines.append(line)
        try:
            request_line = lines[0].decode("ascii").rstrip("\r\n")
        except UnicodeDecodeError:
            raise _BadRequest(400) from None
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
            raise _BadRequest(400)
        if any(b":" not in header for header in lines[1:]):
            raise _BadRequest(400)
        method, target = parts[0], parts[1]
        return method, target.split("?", 1)[0]

    def _respond(self, method: str, path: str) -> tuple[int, str, bytes, dict[str, str]]:
        if path not in ("/metrics", "/healthz"):
            return 404, "text/plain; charset=utf-8", b"not found\n", {}
        if method not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", b"method not allowed\n", {"Allow": "GET, HEAD"}
        if path == "/healthz":
            return 200, "text/plain; charset=utf-8", b"ok\n", {}
        try:
            body = self._registry.render().encode("utf-8")
        except Exception:
            logger.exception("rendering metrics failed")
            return 500, "text/plain; charset=utf-8", b"internal error\n", {}
        return 200, CONTENT_TYPE, body, {}

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            method = "GET"
            try:
                async with asyncio.timeout(self._io_timeout):
                    method, path = await self._read_head(reader)
                status, ctype, body, extra = self._respond(method, path)
            except TimeoutError:
                status, ctype, body, extra = 408, "text/plain; charset=utf-8", b"timeout\n", {}
            except _BadRequest as exc:
                status, ctype, extra = exc.status, "text/plain; charset=utf-8", {}
                body = f"{_REASONS[exc.status].lower()}\n".encode()
            head = [
                f"HTTP/1.1 {status} {_REASONS[status]}",
                f"Content-Type: {ctype}",
                f"Content-Length: {len(body)}",
                "Connection: close",
                *(f"{k}: {v}" for k, v in extra.items()),
            ]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode("ascii"))
            if method != "HEAD":
                writer.write(body)
            async with asyncio.timeout(self._io_timeout):
                await writer.drain()
        except (ConnectionError, TimeoutError):
            pass  # the client went away or stopped reading; nothing to tell it
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()
            self._connections.discard(task)

    async def close(self) -> None:
        """Stop listening and drop open connections. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        connections = list(self._connections)
        for task in connections:
            task.cancel()
        await asyncio.gather(*connections, return_exceptions=True)
        await server.wait_closed()

    async def __aenter__(self) -> MetricsServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def serve_metrics(
    registry: MetricsRegistry, host: str = "127.0.0.1", port: int = 0, *, io_timeout: float = 5.0
) -> MetricsServer:
    """Serve `registry` over HTTP on (host, port); port 0 picks a free port (see `.port`).

    io_timeout bounds both reading the request head and writing the response, so a slow or stuck
    client holds a connection for at most about 2 * io_timeout.
    """
    server = MetricsServer(registry, io_timeout=io_timeout)
    await server._start(host, port)
    return server
