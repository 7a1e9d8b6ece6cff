"""`pdserve proxy`: the public gRPC endpoint in front of the decode tier.

A gRPC-aware (HTTP/2, per-call) proxy: every call that reaches it — whatever the service, so
Generate, GetModelInfo and server reflection alike — is forwarded as raw bytes to one decode
node, chosen per call among the healthy ones (`--routing kv`, the default: a Generate call goes
where its prompt's prefix is likely cached, its load considered, see pdserve/prefix_router.py;
other calls, and all under `--routing least-loaded`: least calls in flight; ties rotate). A TCP (L4)
balancer would pin each client connection, and with it all of that client's calls, to one
replica; this one spreads calls from a single long-lived client channel over every replica.

Backends are given as HOST:PORT; a DNS name stands for every address behind it and is
re-resolved every health round (`--health-interval`), so the replicas of a scaled compose
service (`--backend decode:50051`) are found as they come and dropped as they go. Each round
also asks every backend `grpc.health.v1.Health/Check`; unhealthy ones get no new calls.

A call whose backend fails with UNAVAILABLE before answering anything (connection refused, the
node is draining) is retried on another backend, up to `--max-attempts` backends in all; once a
backend has answered, its status and trailers are passed through unchanged. The client's
deadline, metadata and cancellation are propagated. The proxy answers `grpc.health.v1` itself:
SERVING while at least one backend is healthy. /metrics (optional) counts calls per backend.

    python -m pdserve.proxy --backend decode:50051 --host 0.0.0.0 --port 50051
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from pdserve.http_proxy import HttpForwarder
from pdserve.prefix_router import ROUTING_MODES, PrefixRouter
from pdserve.prompt_key import GENERATE_METHOD, PromptKey, grpc_key
from pdserve.proxy_backends import Backend, backend_pool
from pdserve.replay import ReplayableRequests
from shared.serving import tracing
from shared.serving.limits import GRPC_CHANNEL_OPTIONS
from shared.serving.metrics import AsgiServer, metrics_app, register_scrape_gauge

log = logging.getLogger("pdserve.proxy")

SERVER_OPTIONS = [*GRPC_CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]
# Set by gRPC itself on every hop: forwarding them would duplicate or contradict the new hop's.
HOP_HEADERS = frozenset(
    {
        "user-agent",
        "te",
        "content-type",
        "host",
        "grpc-timeout",
        "grpc-encoding",
        "grpc-accept-encoding",
        "grpc-status",
        "grpc-message",
    }
)


def forwardable(metadata: Sequence[tuple[str, str | bytes]] | None) -> list[tuple[str, object]]:
    return [(k, v) for k, v in (metadata or ()) if k not in HOP_HEADERS and not k.startswith(":")]


class Proxy:
    def __init__(
        self,
        backends: Sequence[str],
        *,
        health_interval: float = 2.0,
        max_attempts: int = 3,
        routing: str = "kv",
    ):
        if not backends:
            raise ValueError("the proxy needs at least one --backend")
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        self.registry = r = CollectorRegistry()
        self.router = PrefixRouter(routing, r)  # which backend gets each call
        self.pool = backend_pool(backends, health_interval, self.router.forget)
        self.max_attempts = max_attempts
        self.server: aio.Server | None = None
        self.health = health.HealthServicer()
        self.metrics_server: AsgiServer | None = None
        self.http: HttpForwarder | None = None
        self.http_server: AsgiServer | None = None
        self.port = 0
        self._health_task: asyncio.Task[None] | None = None
        self.calls = Counter(
            "pdserve_proxy_calls_total",
            "Calls finished through the proxy, by backend and gRPC status",
            labelnames=("backend", "code"),
            registry=r,
        )
        self.retries = Counter(
            "pdserve_proxy_retries_total",
            "Calls moved to another backend before any answer",
            registry=r,
        )
        register_scrape_gauge(
            r,
            "pdserve_proxy_backend_healthy",
            "1 while a backend gets new calls, 0 while it is skipped as unhealthy",
            lambda: {(b.target,): float(b.healthy) for b in self.pool.replicas},
            labelnames=("backend",),
        )
        register_scrape_gauge(
            r,
            "pdserve_proxy_backend_inflight",
            "Calls in flight per backend",
            lambda: {(b.target,): float(b.load) for b in self.pool.replicas},
            labelnames=("backend",),
        )

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(
        self,
        host: str,
        port: int,
        metrics_port: int = -1,
        http_port: int = -1,
        backend_http_port: int = 8000,
    ) -> None:
        await self.pool.refresh()
        self._set_serving(self.pool.any_healthy())
        self._health_task = asyncio.create_task(self._health_loop())
        self.server = aio.server(options=SERVER_OPTIONS)
        # the health service is answered here; every other method goes to a backend
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.server.add_generic_rpc_handlers([_ForwardHandler(self)])
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind the proxy to {host}:{port}")
        await self.server.start()
        if metrics_port >= 0:
            app = metrics_app(self.registry, self.pool.any_healthy)
            self.metrics_server = await AsgiServer.start(app, host, metrics_port, service="metrics")
        if http_port >= 0:  # the OpenAI-compatible API, forwarded (pdserve/http_proxy.py)
            self.http = HttpForwarder(
                self.pool,
                self.router,
                self.registry,
                backend_port=backend_http_port,
                max_attempts=self.max_attempts,
            )
            self.http_server = await AsgiServer.start(self.http.app(), host, http_port)
        log.info(
            "proxy serving on %s:%d, backends %s", host, self.port, ",".join(self.pool.targets)
        )

    async def stop(self, grace: float = 30.0) -> None:
        """Stop accepting calls, let in-flight ones finish within `grace`, release everything."""
        self._set_serving(False)
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.server is not None:
            await self.server.stop(grace)
        if self.http_server is not None:
            await self.http_server.close(grace)
        if self.http is not None:
            await self.http.close()
        await self.pool.close()
        if self.metrics_server is not None:
            await self.metrics_server.close()

    def _set_serving(self, ok: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ok
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.health.set("", status)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.pool.health_interval)
            try:
                await self.pool.refresh()
            except Exception:  # keep the loop alive whatever one round hits
                log.exception("backend refresh failed")
            self._set_serving(self.pool.any_healthy())

    # ---- forwarding -----------------------------------------------------------------------
    async def forward(
        self, method: str, request_iterator: AsyncIterator[bytes], context: aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        incoming = context.invocation_metadata()
        span = tracing.server_span("proxy.route", incoming, {"rpc.method": method})
        metadata = tracing.inject(forwardable(incoming), span)  # the decode node's parent
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        requests = ReplayableRequests(request_iterator)
        tried: set[str] = set()
        last_error = "no decode node is known"
        try:
            key = await self._prompt_key(method, requests)
            for attempt in range(self.max_attempts):
                backend = self.router.route(self.pool, key, tried)
                if backend is None:
                    break
                tried.add(backend.target)
                call = self._open(backend, method, metadata, deadline, key)
                writer = asyncio.create_task(requests.feed(call))
                answered = False
                code = grpc.StatusCode.UNKNOWN
                try:
                    async for response in call:
                        if not answered:
                            answered = True
                            requests.commit()
                            with contextlib.suppress(Exception):
                                await context.send_initial_metadata(
                                    forwardable(await call.initial_metadata())
                                )
                        yield response
                    code = grpc.StatusCode.OK
                    context.set_trailing_metadata(
                        tuple(forwardable(await call.trailing_metadata()))  # type: ignore[arg-type]
                    )
                    return
                except aio.AioRpcError as e:
                    code = e.code()
                    retry = not answered and requests.replayable
                    retry = retry and attempt + 1 < self.max_attempts
                    last_error = await self._failed(method, backend, e, retry, context)
                except (asyncio.CancelledError, GeneratorExit):
                    code = grpc.StatusCode.CANCELLED  # the client went away
                    raise
                finally:
                    self.router.release(backend, key)
                    self.calls.labels(backend.target, code.name).inc()
                    tracing.attempt(span, backend.target, code.name, code == grpc.StatusCode.OK)
                    writer.cancel()
                    call.cancel()
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"no decode node could take the call ({last_error})"
            )
        finally:
            await requests.close()
            tracing.end(span)

    def _open(
        self,
        backend: Backend,
        method: str,
        metadata: list[tuple[str, object]],
        deadline: float | None,
        key: PromptKey | None,
    ) -> aio.StreamStreamCall:
        """The call to `backend`, within what is left of the client's deadline; if it cannot
        be made, the route taken for it is released."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return backend.channel.stream_stream(method)(metadata=metadata or None, timeout=timeout)
        except BaseException:
            self.router.release(backend, key)
            raise

    async def _prompt_key(self, method: str, requests: ReplayableRequests) -> PromptKey | None:
        """A Generate call's prompt key, when the routing wants one (the request message is
        read first: Generate takes exactly one)."""
        if not self.router.uses_keys or method != GENERATE_METHOD:
            return None
        return grpc_key(method, await requests.first())

    async def _failed(
        self,
        method: str,
        backend: Backend,
        e: aio.AioRpcError,
        retry: bool,
        context: aio.ServicerContext,
    ) -> str:
        """A backend's call failed before answering: UNAVAILABLE is retried elsewhere (when
        `retry` allows); anything else goes to the client as it came. Returns the error."""
        if e.code() != grpc.StatusCode.UNAVAILABLE or not retry:
            await context.abort(
                e.code(),
                e.details() or "",
                tuple(forwardable(e.trailing_metadata())),  # type: ignore[arg-type]
            )
        # until the next health round says otherwise
        self.pool.mark_unhealthy(backend, f"{method} answered UNAVAILABLE")
        log.info("%s on %s: UNAVAILABLE, retrying elsewhere", method, backend.target)
        self.retries.inc()
        return f"{backend.target}: {e.details()}"


class _ForwardHandler(grpc.GenericRpcHandler):
    def __init__(self, proxy: Proxy):
        self.proxy = proxy

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        proxy = self.proxy

        async def forward(
            request_iterator: AsyncIterator[bytes], context: aio.ServicerContext
        ) -> AsyncIterator[bytes]:
            async for response in proxy.forward(method, request_iterator, context):
                yield response

        # no (de)serializers: messages pass through as bytes, whatever the service
        return grpc.stream_stream_rpc_method_handler(forward)


# -------------------------------------------------------------------------------- entry point
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        required=True,
        help="HOST:PORT[,HOST:PORT...] of decode nodes; a DNS name stands for all its addresses",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=-1, help="-1 disables /metrics")
    p.add_argument("--http-port", type=int, default=-1, help="forward the HTTP API (-1: off)")
    p.add_argument("--backend-http-port", type=int, default=8000, help="decode nodes' HTTP port")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds")
    p.add_argument("--max-attempts", type=int, default=3, help="backends tried per call")
    p.add_argument(
        "--routing",
        choices=ROUTING_MODES,
        default="kv",
        help="kv: where the prompt's prefix is likely cached, load considered; "
        "least-loaded: fewest calls in flight",
    )
    p.add_argument("--grace", type=float, default=30.0, help="drain time on SIGTERM, seconds")
    p.add_argument("--log-level", default="warning")
    tracing.endpoint_arg(p)


def run(a: argparse.Namespace) -> int:
    import uvloop

    logging.basicConfig(
        level=getattr(logging, a.log_level.upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    backends = [t.strip() for t in a.backend.split(",") if t.strip()]
    for t in backends:
        host, sep, port = t.rpartition(":")
        if not sep or not host or not port.isdigit():
            print(f"pdserve proxy: invalid backend {t!r} (want HOST:PORT)", file=sys.stderr)
            return 2

    async def main() -> int:
        proxy = Proxy(
            backends,
            health_interval=a.health_interval,
            max_attempts=a.max_attempts,
            routing=a.routing,
        )
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        await proxy.start(a.host, a.port, a.metrics_port, a.http_port, a.backend_http_port)
        info = {
            "role": "proxy",
            "port": proxy.port,
            "metrics_port": proxy.metrics_server.port if proxy.metrics_server else None,
            "http_port": proxy.http_server.port if proxy.http_server else None,
        }
        print("PDSERVE_READY " + json.dumps(info), flush=True)
        await stopping.wait()
        log.info("shutting down")
        await proxy.stop(a.grace)
        return 0

    tracing.setup("pdserve-proxy", a.otlp_traces_endpoint)
    try:
        return uvloop.run(main())
    finally:
        tracing.shutdown()  # exports the spans still buffered


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve proxy", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
