"""The proxy's HTTP side: the OpenAI-compatible API forwarded to the decode tier.

Each request goes to the healthy decode replica the proxy's `PrefixRouter` picks from its
`ReplicaPool` (the same pick, prefix index and in-flight counts as gRPC calls, so both APIs share
one view): under kv routing a completion or chat request is keyed on its prompt (pdserve/
prompt_key.py), anything else, a malformed body included (forwarded untouched: the replica
answers the 400), goes least-loaded. It is sent to the replica's address with
`--backend-http-port`. Responses stream back unbuffered (SSE chunks are
passed on as they arrive); a client that disconnects closes the upstream connection, which the
decode node treats as a cancel. A replica that refuses the connection is marked unhealthy and the
request goes to another one (nothing was sent yet); once a replica answered, its status and body
pass through unchanged, except a completion's (pdserve/http_resume.py): one whose replica
fails before answering is sent whole to another, and a stream whose replica is lost mid-stream
is continued on another (`--max-resumes`, within the client's X-Request-Timeout). A stored
Responses API answer lives on the replica that made it: a request naming one (`GET`/`DELETE
/v1/responses/{id}`, a `previous_response_id`) that a replica answers 404 `response_not_found`
is asked of the next one, until one has it or all were asked.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

import httpx
from prometheus_client import CollectorRegistry, Counter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pdserve.http_resume import HttpLedger, ResumingStream, Upstream, ledger_for
from pdserve.prompt_key import PromptKey, http_key
from shared.serving import tracing
from shared.serving.http.app import ClientGone, until_disconnect
from shared.serving.http.errors import ApiError
from shared.serving.http.guard import ApiGuard
from shared.serving.metrics import metrics_routes

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from pdserve.prefix_router import PrefixRouter
    from shared.serving.replica_pool import Replica, ReplicaPool

log = logging.getLogger("pdserve.proxy")

# RFC 9110 7.6.1: meaningful for one connection only, never forwarded
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
MAX_PROXY_BODY_BYTES = 64 * 1024 * 1024
RESPONSES_PATH = "/v1/responses"
NOT_STORED_HERE = "response_not_found"  # the decode node's code (shared/serving/http/responses)
CONNECT_TIMEOUT = 2.0  # the same network: a replica that does not accept in 2 s is gone


def _forwardable(headers: httpx.Headers | list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    if isinstance(headers, httpx.Headers):
        items = headers.multi_items()
    else:
        items = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
    return [(k, v) for k, v in items if k.lower() not in _HOP_BY_HOP]


def http_address(backend: Replica, port: int) -> str:
    host = backend.target.rpartition(":")[0]  # "[::1]" stays bracketed
    return f"{host}:{port}"


class _Relay(StreamingResponse):
    """Streams `body` (the upstream's, maybe rewritten) through with the upstream's status and
    headers; on every exit (done, client gone, cancelled) `release` is called and the upstream
    call closed (`close`) exactly once."""

    def __init__(
        self,
        upstream: httpx.Response,
        body: AsyncIterator[bytes],
        release: Callable[[], None],
        close: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(body, status_code=upstream.status_code)
        self.raw_headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in _forwardable(upstream.headers)
        ]
        self.release, self.close = release, close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()
            await self.close()


async def _relayed(upstream: httpx.Response, target: str) -> AsyncIterator[bytes]:
    """The upstream body as it comes. A replica lost mid-stream (killed, connection reset) ends
    an event stream the way a node's own failure does, with an error event (503: retry) and
    [DONE], so that the client is told rather than cut off; any other body just ends."""
    last = b"\n\n"
    try:
        async for chunk in upstream.aiter_raw():
            last = chunk[-2:] or last
            yield chunk
    except httpx.HTTPError as e:
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            raise
        log.warning("HTTP stream from %s lost mid-stream: %r", target, e)
        error = ApiError(503, f"decode node {target} failed mid-stream: {e!r}")
        # an event cut short is closed first: the error is an event of its own
        yield (b"" if last == b"\n\n" else b"\n\n") + error.sse_event() + b"data: [DONE]\n\n"


def _names_stored_response(request: Request, body: bytes) -> bool:
    """Whether the request needs a stored response, which only the replica that made it has."""
    path = request.url.path
    if path.startswith(RESPONSES_PATH + "/"):
        return request.method in ("GET", "DELETE")
    if path != RESPONSES_PATH or request.method != "POST":
        return False
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(parsed, dict) and parsed.get("previous_response_id") is not None


async def _read_404(response: httpx.Response) -> tuple[Response, bool]:
    """A replica's 404 (an error object: small) read whole, and whether it says that replica
    does not hold the stored response (another may)."""
    content = await response.aread()
    await response.aclose()
    answer = Response(content, 404, headers=dict(_forwardable(response.headers)))
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return answer, False
    return answer, isinstance(error, dict) and error.get("code") == NOT_STORED_HERE


class HttpForwarder:
    def __init__(
        self,
        pool: ReplicaPool[Replica],
        router: PrefixRouter,
        registry: CollectorRegistry,
        *,
        backend_port: int,
        max_attempts: int,
        http_targets: Mapping[str, str] | None = None,
        max_resumes: int = 0,
        resumes: Counter | None = None,
    ) -> None:
        self.pool = pool
        # gRPC target -> HOST:PORT of its HTTP API, where replicas share a host (`pdserve up`);
        # any other replica: its host on `backend_port`
        self.http_targets = dict(http_targets or {})
        self.router = router
        self.backend_port = backend_port
        self.max_attempts = max_attempts
        # streams moved off a lost node (pdserve/http_resume.py): `pdserve proxy --max-resumes`
        # and the gRPC side's counter, pdserve_proxy_resumes_total{outcome}
        self.max_resumes = max_resumes if resumes is not None else 0
        self.resumes = resumes
        # no read timeout: a stream lasts as long as its generation; the client's own
        # deadline (or disconnect) ends it
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self.requests = Counter(
            "pdserve_proxy_http_requests_total",
            "HTTP requests forwarded, by backend and HTTP status",
            labelnames=("backend", "status"),
            registry=registry,
        )
        self.registry = registry

    def app(self) -> ApiGuard:
        routes = [
            *metrics_routes(self.registry, self.pool.any_healthy),
            Route("/{path:path}", self.forward, methods=["GET", "POST", "HEAD", "DELETE"]),
        ]
        app = Starlette(routes=routes)
        return ApiGuard(app, api_key=None, max_request_bytes=MAX_PROXY_BODY_BYTES)

    async def forward(self, request: Request) -> Response:
        """`_forward` in a `proxy.route` span (parented by the client's traceparent) that ends
        when the response does (a relayed stream: when the relay closes)."""
        span = tracing.server_span("proxy.route", request.headers, {"url.path": request.url.path})
        try:
            response = await self._forward(request, span)
        except BaseException as e:
            tracing.fail(span, e)
            tracing.end(span)
            raise
        if isinstance(response, _Relay):
            response.release = tracing.end_with(span, response.release)
        else:
            if response.status_code >= 500:
                tracing.error_status(span, f"HTTP {response.status_code}")
            tracing.end(span)
        return response

    async def _forward(self, request: Request, span: Span | None) -> Response:
        body = await request.body()
        headers = tracing.inject(_forwardable(request.scope["headers"]), span)
        key = self._prompt_key(request, body)
        stored = _names_stored_response(request, body)
        ledger = self._ledger(request, body)
        # a stored response is looked for on every replica; anything else retries connects only
        attempts = max(self.max_attempts, len(self.pool.replicas)) if stored else self.max_attempts
        attempts += self.max_resumes if ledger is not None else 0
        tried: set[str] = set()
        last_error = "no decode node is known"
        not_here: Response | None = None
        for _ in range(attempts):
            backend = self.router.route(self.pool, key, tried)
            if backend is None:
                break
            tried.add(backend.target)
            sent = headers if ledger is None else ledger.headers(headers)
            try:
                response = await self._send(request, backend, sent, body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                self.router.release(backend, key)
                # until the next health round says otherwise
                self.pool.mark_unhealthy(backend, f"HTTP connect failed: {e!r}")
                last_error = f"{backend.target}: {e!r}"
                log.info("HTTP %s on %s: %r, retrying elsewhere", request.url.path, backend, e)
                continue
            except ClientGone:
                self.router.release(backend, key)
                return Response(status_code=499)  # nobody reads it: the client is gone
            except httpx.HTTPError as e:  # connected, then the replica failed before answering
                self.router.release(backend, key)
                refusal = self._lost_before_answer(ledger, backend, e)
                if refusal is None:
                    continue
                return refusal
            except BaseException:
                self.router.release(backend, key)
                raise
            if stored and response.status_code == 404:  # read whole: maybe ask the next one
                self.router.release(backend, key)
                not_here, elsewhere = await _read_404(response)
                if elsewhere:
                    continue
                return not_here
            self.requests.labels(backend.target, str(response.status_code)).inc()
            ok = response.status_code < 500
            tracing.attempt(span, backend.target, f"HTTP {response.status_code}", ok)
            upstream = Upstream(
                backend.target, response, lambda b=backend: self.router.release(b, key)
            )
            return self._relay(request, upstream, ledger, key, headers, tried)
        if not_here is not None:  # every replica was asked: none holds it
            return not_here
        return ApiError(503, f"no decode node could take the request ({last_error})").response()

    async def _send(
        self, request: Request, backend: Replica, headers: list[tuple[str, str]], body: bytes
    ) -> httpx.Response:
        url = httpx.URL(
            f"http://{self._address(backend)}{request.url.path}", query=request.url.query.encode()
        )
        upstream = self.client.build_request(request.method, url, headers=headers, content=body)
        return await until_disconnect(request, self.client.send(upstream, stream=True))

    def _ledger(self, request: Request, body: bytes) -> HttpLedger | None:
        if not self.max_resumes:
            return None
        timeout = request.headers.get("x-request-timeout")
        return ledger_for(request.method, request.url.path, body, timeout)

    def _relay(
        self,
        request: Request,
        upstream: Upstream,
        ledger: HttpLedger | None,
        key: PromptKey | None,
        headers: list[tuple[str, str]],
        tried: set[str],
    ) -> _Relay:
        """The answer passed on: as it comes, or a resumable stream through its ledger."""
        response = upstream.response
        streamed = response.headers.get("content-type", "").startswith("text/event-stream")
        if ledger is None or not streamed or response.status_code != 200:
            if ledger is not None and ledger.resumes:  # retried whole, and answered
                self._outcome("completed")
            body = _relayed(response, upstream.target)
            return _Relay(response, body, upstream.release, response.aclose)

        async def reopen(lost: str, continuation: bytes) -> Upstream | None:
            for replica in self.pool.replicas:  # until the next health round says otherwise
                if replica.target == lost:
                    self.pool.mark_unhealthy(replica, f"HTTP {request.url.path} lost mid-stream")
            return await self._reopen(request, ledger, key, headers, tried, continuation)

        stream = ResumingStream(
            ledger, upstream, max_resumes=self.max_resumes, reopen=reopen, outcome=self._outcome
        )
        return _Relay(response, stream.body(), lambda: None, lambda: stream.current.close())

    async def _reopen(
        self,
        request: Request,
        ledger: HttpLedger,
        key: PromptKey | None,
        headers: list[tuple[str, str]],
        tried: set[str],
        continuation: bytes,
    ) -> Upstream | None:
        """The continuation sent to the next healthy replica that takes it (None: none)."""
        while (backend := self.router.route(self.pool, key, tried)) is not None:
            tried.add(backend.target)
            try:
                response = await self._send(request, backend, ledger.headers(headers), continuation)
            except httpx.HTTPError as e:
                self.router.release(backend, key)
                self.pool.mark_unhealthy(backend, f"HTTP resume failed: {e!r}")
                continue
            except BaseException:
                self.router.release(backend, key)
                raise
            self.requests.labels(backend.target, str(response.status_code)).inc()
            return Upstream(backend.target, response, lambda b=backend: self.router.release(b, key))
        return None

    def _lost_before_answer(
        self, ledger: HttpLedger | None, backend: Replica, e: httpx.HTTPError
    ) -> Response | None:
        """A replica failed after taking the request, before answering: a completion is sent
        whole to another one (None: retry), within `--max-resumes` and its deadline; anything
        else, or a completion past those bounds, gets the error returned."""
        why = f"decode node {backend.target} failed before answering: {e!r}"
        if ledger is None:
            self.requests.labels(backend.target, "502").inc()
            return ApiError(502, why).response()
        if ledger.resumes >= self.max_resumes:
            self._outcome("failed")
            tries = f"retried {ledger.resumes} time(s) already (--max-resumes {self.max_resumes})"
            return ApiError(503, f"{why}; {tries}").response()
        left = ledger.remaining()
        if left is not None and left <= 0:
            self._outcome("failed")
            return ApiError(504, f"{why}; the request's deadline passed").response()
        self.pool.mark_unhealthy(backend, f"HTTP request lost before answering: {e!r}")
        log.warning("%s: sending the request to another node", why)
        ledger.resumes += 1
        return None

    def _outcome(self, outcome: str) -> None:
        if self.resumes is not None:
            self.resumes.labels(outcome).inc()

    def _address(self, backend: Replica) -> str:
        return self.http_targets.get(backend.target) or http_address(backend, self.backend_port)

    def _prompt_key(self, request: Request, body: bytes) -> PromptKey | None:
        if not self.router.uses_keys:
            return None
        return http_key(request.method, request.url.path, body)

    async def close(self) -> None:
        await self.client.aclose()
