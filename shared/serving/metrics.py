"""Node metrics on prometheus_client, and the small ASGI endpoint that serves them.

Each node owns its own `CollectorRegistry` (tests run several nodes in one process). Counters and
histograms are prometheus_client's own; values that live in other objects (seats, blocks, peer
health) are read at scrape time by a `ScrapeCollector`, so hot paths never touch the registry.
`/metrics` and `/health` are Starlette routes served by uvicorn on the node's own event loop
(`AsgiServer`), the same stack the OpenAI-compatible HTTP API runs on.

    registry = CollectorRegistry()
    ttft = Histogram("pdserve_ttft_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=registry)
    register_scrape_gauge(registry, "pdserve_seats_in_use", "Busy seats", lambda: seats())
    server = await AsgiServer.start(metrics_app(registry, lambda: True), "127.0.0.1", 0)
    ...
    await server.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
from collections.abc import Callable, Iterator, Mapping, Sequence

import uvicorn
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from shared.serving.connection_limits import ConnectionLimits
from shared.serving.port_in_use import PortInUse

__all__ = [
    "CONTENT_TYPE",
    "LATENCY_BUCKETS",
    "AsgiServer",
    "CollectorRegistry",
    "ScrapeCollector",
    "metrics_app",
    "metrics_routes",
    "parse_prometheus_text",
    "register_scrape_counter",
    "register_scrape_gauge",
    "render",
    "ttft_prediction_error_histogram",
]

logger = logging.getLogger(__name__)

# The exposition stays what it was: no `*_created` series beside every counter and histogram.
disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# Seconds; spans sub-millisecond steps up to minute-long requests.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

# Seconds, signed: predicted minus actual (positive: the prediction was pessimistic).
PREDICTION_ERROR_BUCKETS: tuple[float, ...] = (
    -30.0,
    -10.0,
    -5.0,
    -2.5,
    -1.0,
    -0.5,
    -0.25,
    -0.1,
    0.0,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

ScrapeValue = float | Mapping[tuple[str, ...] | str, float]


class ScrapeCollector(Collector):
    """One gauge (or monotonic counter) whose samples `fn` computes at scrape time.

    For a labelled family, `fn` returns {label values tuple (or one str): value}. A failing
    callback drops only its own family from the scrape, never the whole page.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        fn: Callable[[], ScrapeValue],
        labelnames: Sequence[str] = (),
        kind: str = "gauge",
    ) -> None:
        self.name, self.documentation, self.fn = name, documentation, fn
        self.labelnames = tuple(labelnames)
        self.kind = kind

    def _family(self) -> GaugeMetricFamily | CounterMetricFamily:
        if self.kind == "counter":
            return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        return GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _samples(self) -> list[tuple[tuple[str, ...], float]]:
        result = self.fn()
        if not self.labelnames:
            if isinstance(result, Mapping):
                raise TypeError(f"{self.name} has no labels; its callback must return a number")
            return [((), float(result))]
        if not isinstance(result, Mapping):
            raise TypeError(f"{self.name} is labelled; its callback must return a dict")
        samples = []
        for key, value in result.items():
            values = (key,) if isinstance(key, str) else tuple(str(k) for k in key)
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: key {key!r} does not match {self.labelnames}")
            samples.append((values, float(value)))
        return samples

    def collect(self) -> Iterator[Metric]:
        try:
            samples = self._samples()
        except Exception:
            logger.exception("metrics callback for %s failed; omitting it", self.name)
            return
        family = self._family()
        for values, value in samples:
            family.add_metric(list(values), value)
        yield family


def register_scrape_gauge(
    registry: CollectorRegistry,
    name: str,
    documentation: str,
    fn: Callable[[], ScrapeValue],
    labelnames: Sequence[str] = (),
) -> ScrapeCollector:
    collector = ScrapeCollector(name, documentation, fn, labelnames)
    registry.register(collector)
    return collector


def register_scrape_counter(
    registry: CollectorRegistry, name: str, documentation: str, fn: Callable[[], float]
) -> ScrapeCollector:
    """A counter its owner keeps (e.g. the KV receiver's rejected-message count)."""
    collector = ScrapeCollector(name, documentation, fn, kind="counter")
    registry.register(collector)
    return collector


def prompt_tokens_counter(registry: CollectorRegistry) -> Counter:
    """pdserve_prompt_tokens_total{source="computed|cached"}, on every node that prefills:
    prompt tokens it computed vs reused from its own prefix cache."""
    counter = Counter(
        "pdserve_prompt_tokens",
        "Prompt tokens this node prefilled: computed, or reused from its prefix cache",
        ["source"],
        registry=registry,
    )
    for source in ("computed", "cached"):
        counter.labels(source=source)
    return counter


def ttft_prediction_error_histogram(registry: CollectorRegistry) -> Histogram:
    """pdserve_ttft_prediction_error_seconds: SLO-aware admission's predicted minus actual
    time to first token, per admitted request (shared/engine/scheduling/slo.py)."""
    return Histogram(
        "pdserve_ttft_prediction_error_seconds",
        "Predicted minus actual time to first token of admitted requests",
        buckets=PREDICTION_ERROR_BUCKETS,
        registry=registry,
    )


def render(registry: CollectorRegistry) -> str:
    """The registry in Prometheus text exposition format 0.0.4."""
    return generate_latest(registry).decode("utf-8")


def parse_prometheus_text(text: str) -> dict[str, float]:
    """{`name` or `name{a="b",...}`: value} for every sample, read by prometheus_client's parser.

    Labels keep the order of the text (prometheus_client writes them sorted by name); values are
    escaped as in the exposition format. For tests and scripts that read a scrape back.
    """
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sample.labels.items())
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            if key in values:
                raise ValueError(f"duplicate sample {key}")
            values[key] = sample.value
    return values


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def metrics_routes(
    registry: CollectorRegistry,
    healthy: Callable[[], bool],
    why: Callable[[], str] | None = None,
) -> list[BaseRoute]:
    """GET /metrics (the registry), GET /health (200 while serving, else 503; `why` adds the
    reason to the body's one line), /healthz alias."""

    async def metrics(request: Request) -> Response:
        # generate_latest runs the scrape collectors: cheap reads of the engine's snapshot
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)

    async def health(request: Request) -> Response:
        reason = "" if why is None else f": {why()}"
        if healthy():
            return PlainTextResponse(f"ok{reason}\n")
        return PlainTextResponse(
            f"not serving{reason}\n", status_code=503, headers={"Retry-After": "1"}
        )

    return [
        Route("/metrics", metrics, methods=["GET", "HEAD"]),
        Route("/health", health, methods=["GET", "HEAD"]),
        Route("/healthz", health, methods=["GET", "HEAD"]),
    ]


def metrics_app(registry: CollectorRegistry, healthy: Callable[[], bool]) -> Starlette:
    return Starlette(routes=metrics_routes(registry, healthy))


class _LoopServer(uvicorn.Server):
    """uvicorn on a loop it does not own: the node keeps its own SIGTERM/SIGINT handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class AsgiServer:
    """An ASGI app served by uvicorn as a task on the running (uvloop) loop; no extra thread."""

    def __init__(self, server: _LoopServer, task: asyncio.Task[None], sock: socket.socket):
        self._server, self._task, self._sock = server, task, sock
        sockname = sock.getsockname()
        self.host, self.port = sockname[0], sockname[1]

    @classmethod
    async def start(
        cls,
        app: object,
        host: str,
        port: int,
        *,
        certfile: str | None = None,
        keyfile: str | None = None,
        client_ca: str | None = None,
        graceful_timeout: float = 5.0,
        service: str = "http",
        limits: ConnectionLimits | None = None,
    ) -> AsgiServer:
        """Bind (host, port) here, so a bad address fails now and port 0 is known at once; a
        port another socket holds raises PortInUse(`service`, ...)."""
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_level="warning",
            access_log=False,
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
            ssl_ca_certs=client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if client_ca else ssl.CERT_NONE,
            timeout_graceful_shutdown=graceful_timeout,
            # read deadlines, keep-alive, connection cap (connection_limits.py says why there)
            **(limits or ConnectionLimits()).uvicorn_options(),
        )
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1024)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(service, host, port) from e
            raise
        config.load()  # here, so a bad certificate raises instead of uvicorn's sys.exit
        server = _LoopServer(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name=f"uvicorn:{port}")
        while not server.started:
            if task.done():  # startup failed (uvicorn exits on a bad TLS file, for one)
                sock.close()
                exc = task.exception()
                raise OSError(f"HTTP server on {host}:{port} did not start: {exc!r}")
            await asyncio.sleep(0.01)
        return cls(server, task, sock)

    @property
    def scheme(self) -> str:
        return "https" if isinstance(self._server.config.ssl, ssl.SSLContext) else "http"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    async def close(self, grace: float | None = None) -> None:
        """Stop listening; open connections get `grace` seconds (default: the one given at
        start), then their tasks are cancelled. Idempotent."""
        if grace is not None:
            self._server.config.timeout_graceful_shutdown = grace
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self._sock.close()
