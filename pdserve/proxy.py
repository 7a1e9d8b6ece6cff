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

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from pdserve.http_proxy import HttpForwarder
from pdserve.prefix_router import PrefixRouter
from pdserve.prompt_key import GENERATE_METHOD, PromptKey, grpc_key
from pdserve.proxy_backends import Backend, backend_pool
from pdserve.proxy_call import ProxiedCall, forwardable, send_one
from pdserve.replay import ReplayableRequests
from pdserve.stream_resume import NODE_LOST, GenerateLedger
from shared.serving import tracing
from shared.serving.limits import GRPC_CHANNEL_OPTIONS
from shared.serving.metrics import AsgiServer, metrics_app, register_scrape_gauge

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger("pdserve.proxy")

SERVER_OPTIONS = [*GRPC_CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]


class Proxy:
    def __init__(
        self,
        backends: Sequence[str],
        *,
        health_interval: float = 2.0,
        max_attempts: int = 3,
        routing: str = "kv",
        max_resumes: int = 2,
    ):
        if not backends:
            raise ValueError("the proxy needs at least one --backend")
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        self.registry = r = CollectorRegistry()
        self.router = PrefixRouter(routing, r)  # which backend gets each call
        self.pool = backend_pool(backends, health_interval, self.router.forget)
        self.backends = list(backends)
        self.max_attempts = max_attempts
        if max_resumes < 0:
            raise ValueError("max_resumes must be >= 0")
        self.max_resumes = max_resumes
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
        self.resumes = Counter(
            "pdserve_proxy_resumes_total",
            "Streams whose decode node failed mid-stream, moved to another node: completed there, "
            "or failed (no node left, --max-resumes or the deadline reached)",
            labelnames=("outcome",),
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
        backend_http: Sequence[str] = (),
    ) -> None:
        """`backend_http`: each backend's HTTP HOST:PORT, in the order of the backends given
        (empty: every backend's host on `backend_http_port`)."""
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
                http_targets=dict(zip(self.backends, backend_http, strict=False)),
                max_resumes=self.max_resumes,
                resumes=self.resumes,
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
        call = ProxiedCall(method, ReplayableRequests(request_iterator), metadata, deadline)
        try:
            call.key = await self._prompt_key(method, call.requests)
            if method == GENERATE_METHOD and self.max_resumes > 0:
                first = await call.requests.first()
                with contextlib.suppress(DecodeError):  # malformed: the node answers it
                    call.ledger = None if first is None else GenerateLedger(first)
            while (backend := self.router.route(self.pool, call.key, call.tried)) is not None:
                call.tried.add(backend.target)
                async for response in self._attempt(call, backend, span, context):
                    yield response
                if call.done:
                    return
            if call.ledger is not None and call.ledger.resumes:
                self.resumes.labels("failed").inc()
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"no decode node could take the call ({call.last_error})",
            )
        finally:
            await call.requests.close()
            tracing.end(span)

    async def _attempt(
        self, call: ProxiedCall, backend: Backend, span: Span | None, context: aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """One backend's try at the call: its answer passed on; `call.done` unless the next
        backend should try (a retry before any answer, or a resume of a stream cut short)."""
        resume = call.resume_request
        rpc = self._open(backend, call.method, call.metadata, call.deadline, call.key)
        feed = call.requests.feed(rpc) if resume is None else send_one(rpc, resume)
        writer = asyncio.create_task(feed)
        code = grpc.StatusCode.UNKNOWN
        try:
            async for response in rpc:
                if not call.answered:
                    call.answered = True
                    call.requests.commit()
                    with contextlib.suppress(Exception):
                        await context.send_initial_metadata(
                            forwardable(await rpc.initial_metadata())
                        )
                yield response if call.ledger is None else call.ledger.record(response)
            code = grpc.StatusCode.OK
            context.set_trailing_metadata(
                tuple(forwardable(await rpc.trailing_metadata()))  # type: ignore[arg-type]
            )
            if resume is not None:
                self.resumes.labels("completed").inc()
            call.done = True
        except aio.AioRpcError as e:
            code = e.code()
            call.done = not await self._next_try(call, backend, e, context)
        except (asyncio.CancelledError, GeneratorExit):
            code = grpc.StatusCode.CANCELLED  # the client went away
            raise
        finally:
            self.router.release(backend, call.key)
            self.calls.labels(backend.target, code.name).inc()
            tracing.attempt(span, backend.target, code.name, code == grpc.StatusCode.OK)
            writer.cancel()
            rpc.cancel()

    async def _next_try(
        self, call: ProxiedCall, backend: Backend, e: aio.AioRpcError, context: aio.ServicerContext
    ) -> bool:
        """Whether another backend should try after `backend` failed with `e`: before any
        answer, an UNAVAILABLE is retried (`--max-attempts`); after one, a Generate stream whose
        node was lost is resumed (`--max-resumes`, within the deadline). Otherwise the client
        gets the error (aborts)."""
        if not call.answered:
            retry = call.requests.replayable and len(call.tried) < self.max_attempts
            call.last_error = await self._failed(call.method, backend, e, retry, context)
            return True
        ledger = call.ledger
        if ledger is None or e.code() not in NODE_LOST or not ledger.resumable:
            await self._abort(e, context)
        if ledger.resumes >= self.max_resumes:
            self.resumes.labels("failed").inc()
            await context.abort(
                e.code(),
                f"decode node {backend.target} failed mid-stream ({e.details()}) and the stream "
                f"was resumed {ledger.resumes} time(s) already (--max-resumes {self.max_resumes})",
            )
        if call.deadline is not None and time.monotonic() >= call.deadline:
            self.resumes.labels("failed").inc()
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"decode node {backend.target} failed mid-stream and the deadline passed",
            )
        self.pool.mark_unhealthy(backend, f"{call.method} lost mid-stream: {e.code().name}")
        log.warning(
            "%s on %s failed after %d tokens (%s): resuming on another node",
            call.method,
            backend.target,
            len(ledger.sent),
            e.code().name,
        )
        call.resume_request = ledger.continuation()
        call.last_error = f"{backend.target} failed mid-stream: {e.details()}"
        return True

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
            await self._abort(e, context)
        # until the next health round says otherwise
        self.pool.mark_unhealthy(backend, f"{method} answered UNAVAILABLE")
        log.info("%s on %s: UNAVAILABLE, retrying elsewhere", method, backend.target)
        self.retries.inc()
        return f"{backend.target}: {e.details()}"

    @staticmethod
    async def _abort(e: aio.AioRpcError, context: aio.ServicerContext) -> NoReturn:
        """The backend's error to the client as it came."""
        await context.abort(
            e.code(),
            e.details() or "",
            tuple(forwardable(e.trailing_metadata())),  # type: ignore[arg-type]
        )
        raise AssertionError("context.abort returned")  # it raises


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


if __name__ == "__main__":  # `python -m pdserve.proxy`, as the images run it
    from pdserve.proxy_main import main

    sys.exit(main())
