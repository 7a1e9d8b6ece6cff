"""The decode node: the public front door.

A `Generate` call waits QUEUED (holding nothing) in the engine's admission queue until the blocks
for its prompt and first token are free (FIFO, bounded by max_queued, its own deadline kept),
then is admitted in DISAGG_GENERATION_INIT (KV blocks reserved and pinned, no seat),
dispatched to the least-loaded healthy prefill node with the destination of those blocks
(DISAGG_GENERATION_TRANS_IN_PROGRESS), and once every layer of every block has landed it becomes
DISAGG_GENERATION_TRANS_COMPLETE: the first token (sampled by the prefill node) is streamed at once
and the next engine iteration seats the request and decodes it in the continuous batch.
Every wait has a deadline enforced by the event loop's timers; every exit path releases the
request on both nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field

import grpc
from grpc import aio

from decode_node.config import DecodeNodeConfig
from decode_node.peers import LayoutMismatch, PrefillPeer, prefill_pool
from proto.pdserve.v1 import generation_pb2, generation_pb2_grpc, prefill_pb2
from shared.engine.core import EngineCore, RequestRejected, ResourcesExhausted
from shared.engine.logprobs import TokenLogprobs
from shared.engine.output import TokenDelta
from shared.engine.request import FinishReason
from shared.engine.sampling_params import SamplingParams
from shared.engine.thread import EngineThread
from shared.engine.transfer_admission import AdmissionClosed, TransferGrant
from shared.serving.grpc_server import (
    GenerateError,
    NodeMetrics,
    NodeServing,
    layout_info,
    model_info,
)
from shared.serving.http import serve_http_api
from shared.serving.metrics import AsgiServer, register_scrape_counter, register_scrape_gauge
from shared.serving.wire import (
    WireError,
    add_servicer,
    logprob_from_proto,
    logprob_to_proto,
    prompt_logprobs_from_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
    sampling_to_proto,
    validate_request,
)
from transfer.protocol import TransferDestination
from transfer.ucx import KvReceiver, TransferError, TransferTimeout

log = logging.getLogger(__name__)
SERVICE_DESCRIPTOR = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
SERVICE = SERVICE_DESCRIPTOR.full_name

_FINISH = {
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.ABORTED: generation_pb2.FINISH_REASON_ABORTED,
}


class _PrefillFailed(Exception):
    """The prefill node could not serve this attempt; another node may."""


@dataclass
class _Stream:
    request_id: str
    prompt_len: int
    queue: asyncio.Queue[TokenDelta] = field(default_factory=asyncio.Queue)
    transfer_id: int | None = None
    peer: PrefillPeer | None = None
    prefill_done: bool = False
    admitted_at: float = field(default_factory=time.monotonic)
    # set by the engine thread's admission callback: a grant, None (deadline passed in the
    # queue) or an exception (drained at shutdown)
    admission: asyncio.Future[TransferGrant | None] | None = None
    admission_wait: float = 0.0  # seconds QUEUED on this node
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    kv_transfer_seconds: float = 0.0
    first_token_at: float | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    deadline: float | None = None  # monotonic; None: the client set none
    n: int = 1  # completions; the stream ends when each has finished
    finished: set[int] = field(default_factory=set)
    tokens_by_index: dict[int, int] = field(default_factory=dict)
    failed: bool = False  # ended by an error: the engine records DISAGG_TRANS_ERROR

    def account(self, delta: TokenDelta) -> None:
        """Count a delta of completion `delta.index` before it is streamed."""
        self.completion_tokens += len(delta.token_ids)
        self.tokens_by_index[delta.index] = self.tokens_by_index.get(delta.index, 0) + len(
            delta.token_ids
        )
        if delta.finish_reason is not None:
            self.finished.add(delta.index)

    def deadline_passed(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


class DecodeNode(generation_pb2_grpc.GenerationServicer):
    def __init__(self, config: DecodeNodeConfig, core: EngineCore | None = None):
        config.validate()
        self.config = config
        self.core = core or EngineCore(config.engine)
        self.core.admission.configure(config.max_queued, config.max_inflight)
        self.layout_info = layout_info(self.core.layout)
        self.streams: dict[str, _Stream] = {}
        self.thread: EngineThread | None = None
        self.receiver = KvReceiver(
            self.core.kv_pool,
            self.core.layout,
            config.ucx_host,
            config.ucx_port,
            bind_host=config.kv_bind_host,
        )
        self.pool = prefill_pool(
            config.prefill_targets,
            config.health_check_interval,
            None if config.prefill_tls is None else config.prefill_tls.credentials(),
        )
        self.metrics = NodeMetrics(
            lambda: self._snapshot(), rejected=lambda: self.receiver.rejected_total
        )
        registry = self.metrics.registry
        register_scrape_gauge(
            registry,
            "pdserve_prefill_peer_healthy",
            "1 while a prefill node is routed to, 0 while it is skipped as unhealthy",
            lambda: {(p.target,): float(p.healthy) for p in self.pool.replicas},
            labelnames=("peer",),
        )
        register_scrape_gauge(
            registry,
            "pdserve_kv_writes_in_flight",
            "KV payload receives posted into the pool and not completed",
            lambda: float(self.receiver.writes_in_flight),
        )
        register_scrape_gauge(
            registry,
            "pdserve_kv_fenced_transfers",
            "ended transfers whose blocks a posted payload receive may still write",
            lambda: float(self.receiver.fenced_transfers),
        )
        register_scrape_counter(
            registry,
            "pdserve_kv_endpoint_resets_total",
            "KV endpoints force-closed to end a receive whose sender stalled mid-payload",
            lambda: float(self.receiver.endpoint_resets),
        )
        self.serving: NodeServing | None = None
        self.http: AsgiServer | None = None
        self.port = 0
        self.accepting = True
        self._tasks: set[asyncio.Future[None]] = set()
        # PrefillResponse of recent requests (timestamps, bytes): the layer-wise evidence
        self.transfer_log: OrderedDict[str, prefill_pb2.PrefillResponse] = OrderedDict()

    def _snapshot(self):
        assert self.thread is not None
        return self.thread.snapshot

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.thread = EngineThread(self.core, loop, self._on_deltas, name="decode-engine")
        self.core.admission.on_admission = lambda rid, grant: loop.call_soon_threadsafe(
            self._on_admission, rid, grant
        )
        self.thread.start()
        await self.receiver.start()
        await self.pool.start()
        self.serving = await NodeServing.start(
            [SERVICE],
            lambda s: add_servicer(s, self, SERVICE_DESCRIPTOR),
            self.config.host,
            self.config.port,
            self.config.tls,
            self.metrics.registry,
            self.config.metrics_port,
        )
        self.port = self.serving.port
        if self.config.http_port >= 0:
            self.http = await serve_http_api(
                self,
                self.config.http_api(self.core.loaded),
                self.metrics.registry,
                self.config.host,
                self.config.http_port,
                self.config.tls,
            )
        log.info(
            "decode node serving on %s:%d (KV listener %s)",
            self.config.host,
            self.port,
            self.receiver.address,
        )

    async def stop(self, grace: float = 5.0) -> bool:
        """Stop admitting, let in-flight work finish within `grace`, abort the rest, release
        everything and return whether seats and blocks were all conserved."""
        self.accepting = False
        conserved = True
        await self._drain_queue()
        if self.serving is not None:
            await asyncio.gather(self.serving.stop_admitting(grace), self._close_http(grace))
        # first: closing the receiver ends every posted KV write, so that the conservation
        # check runs on blocks nothing can write any more
        await self.receiver.close()
        if self.thread is not None:
            conserved = await self.thread.call(lambda core: core.shutdown())
            self.thread.stop()
        await self.pool.close()
        if self.serving is not None:
            await self.serving.close_metrics()
        return conserved

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    async def _close_http(self, grace: float) -> None:
        """In-flight HTTP streams get `grace`, like gRPC calls; then they are cancelled."""
        if self.http is not None:
            await self.http.close(grace)

    async def _drain_queue(self) -> None:
        """Shutting down: requests still queued are answered UNAVAILABLE now (they hold
        nothing; another node can serve them), not left to be cut off at the grace's end."""
        if self.thread is None:
            return
        with contextlib.suppress(RuntimeError):
            drained = await self.thread.call(lambda core: core.admission.drain(core))
            for rid in drained:
                stream = self.streams.get(rid)
                if stream is not None and stream.admission and not stream.admission.done():
                    stream.admission.set_exception(
                        GenerateError(
                            grpc.StatusCode.UNAVAILABLE,
                            f"decode node is shutting down; {rid} was still queued and was "
                            "never started: retry on another node",
                        )
                    )

    def _on_admission(self, rid: str, grant: TransferGrant | None) -> None:
        stream = self.streams.get(rid)
        if stream is not None and stream.admission is not None and not stream.admission.done():
            stream.admission.set_result(grant)

    def _on_deltas(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            stream = self.streams.get(delta.request_id)
            if stream is not None:
                stream.queue.put_nowait(delta)

    # ---- RPCs -----------------------------------------------------------------------------
    async def GetModelInfo(self, request, context):
        return model_info(self.core, generation_pb2.NODE_ROLE_DECODE)

    async def Generate(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        try:
            async for response in self._generate(rid, request, context.time_remaining()):
                yield response
        except GenerateError as e:
            await context.abort(e.code, str(e), trailing_metadata=e.trailing_metadata)

    async def _generate(
        self, rid: str, request: generation_pb2.GenerateRequest, time_left: float | None
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        deadline = None if time_left is None else time.monotonic() + time_left
        prompt, params = self._parse(request)
        # closed explicitly: a cancelled call releases the request now, not when collected
        async with contextlib.aclosing(self.generate(rid, prompt, params, deadline)) as gen:
            async for stream, delta in gen:
                yield self._response(stream, delta)

    async def generate(
        self, rid: str, prompt: list[int], params: SamplingParams, deadline: float | None
    ) -> AsyncIterator[tuple[_Stream, TokenDelta]]:
        """The one request path, for gRPC and HTTP alike: admit, reserve, dispatch the prefill,
        stream the deltas; release on both nodes on every exit (finish, error, the consumer
        cancelled or closed). Raises GenerateError with the status to report."""
        if not self.accepting:
            raise GenerateError(grpc.StatusCode.UNAVAILABLE, "decode node is shutting down")
        if rid in self.streams:
            raise GenerateError(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id {rid!r} is already in flight"
            )
        stream = _Stream(rid, len(prompt), deadline=deadline, n=params.n)
        self.streams[rid] = stream
        try:
            for first in await self._admit_and_transfer(stream, prompt, params, deadline):
                stream.account(first)
                yield stream, first
            while len(stream.finished) < stream.n:
                delta = await self._next_delta(stream, deadline)
                stream.account(delta)
                yield stream, delta
        except GenerateError:
            stream.failed = True
            raise
        finally:
            await asyncio.shield(self._release(stream))

    def validate(
        self, prompt: list[int], params: SamplingParams, request_id: str = ""
    ) -> SamplingParams:
        """The wire bounds and the engine's checks, before anything is allocated (gRPC and HTTP
        alike); the seed resolved."""
        try:
            validate_request(request_id, params, self.core.model_config.vocab_size)
            self.core.validate_request(prompt, params)
        except (WireError, RequestRejected) as e:
            raise GenerateError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return params.with_resolved_seed()

    @property
    def healthy(self) -> bool:
        """Serving and at least one prefill node routed to (HTTP /health)."""
        return self.accepting and self.pool.any_healthy()

    async def _next_delta(self, stream: _Stream, deadline: float | None) -> TokenDelta:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        prev = time.monotonic()
        try:
            delta = await asyncio.wait_for(stream.queue.get(), timeout)
        except TimeoutError:
            raise GenerateError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"request {stream.request_id} exceeded its deadline while decoding",
            ) from None
        self.metrics.itl.observe(time.monotonic() - prev)
        return delta

    def _parse(self, request: generation_pb2.GenerateRequest) -> tuple[list[int], SamplingParams]:
        which = request.WhichOneof("prompt")
        if which == "text":
            if not request.text:
                raise GenerateError(grpc.StatusCode.INVALID_ARGUMENT, "prompt text is empty")
            prompt = self.core.tokenizer.encode(request.text)
        elif which == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            raise GenerateError(
                grpc.StatusCode.INVALID_ARGUMENT, "prompt is missing: set text or token_ids"
            )
        params = sampling_from_proto(request.sampling)
        return prompt, self.validate(prompt, params, request.request_id)

    # ---- admission and transfer -----------------------------------------------------------
    async def _admit_and_transfer(
        self,
        stream: _Stream,
        prompt: list[int],
        params: SamplingParams,
        deadline: float | None,
    ) -> list[TokenDelta]:
        """Admit (queued until blocks are free), prefill on a peer, land the KV; returns the
        first token's delta of each of the n completions."""
        assert self.thread is not None
        grant = await self._admit(stream, prompt, params, deadline)
        rid = stream.request_id
        blocks, first_block = grant.blocks, grant.first_block
        stream.cached_tokens = grant.request.cached_tokens
        tried: set[str] = set()
        last_error = "every prefill node is marked unhealthy (failing health checks)"
        for _ in range(1 + self.config.prefill_retries):
            peer = self.pool.pick(tried)
            if peer is None:
                break
            tried.add(peer.target)
            try:
                response = await self._prefill_once(
                    stream, peer, prompt, params, blocks, first_block, deadline
                )
            except _PrefillFailed as e:
                last_error = str(e)
                continue
            first = _first_token(response, params)
            deltas = await self.thread.call(
                lambda core, first=first: core.complete_transfer_all(rid, *first)
            )
            stream.first_token_at = time.monotonic()
            self.metrics.ttft.observe(stream.first_token_at - stream.admitted_at)
            return deltas
        raise GenerateError(
            grpc.StatusCode.UNAVAILABLE,
            f"no healthy prefill node could serve {rid}: {last_error}",
        )

    async def _admit(
        self,
        stream: _Stream,
        prompt: list[int],
        params: SamplingParams,
        deadline: float | None,
    ) -> TransferGrant:
        """Queue the request and wait (its deadline kept) until it holds its blocks."""
        assert self.thread is not None
        rid = stream.request_id
        stream.admission = asyncio.get_running_loop().create_future()
        try:
            await self.thread.call(
                lambda core: core.admission.enqueue(core, prompt, params, rid, deadline)
            )
        except RequestRejected as e:
            raise GenerateError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except ResourcesExhausted as e:
            raise GenerateError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), e.retry_after_s
            ) from None
        except AdmissionClosed as e:
            raise GenerateError(grpc.StatusCode.UNAVAILABLE, f"decode node: {e}") from None
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            grant = await asyncio.wait_for(asyncio.shield(stream.admission), timeout)
        except TimeoutError:
            grant = None
        if grant is None:
            raise GenerateError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"request {rid} exceeded its deadline while queued for KV blocks "
                f"({time.monotonic() - stream.admitted_at:.2f}s queued)",
            )
        stream.admission_wait = grant.queue_seconds
        self.metrics.queue_seconds.observe(grant.queue_seconds)
        return grant

    async def _prefill_once(
        self,
        stream: _Stream,
        peer: PrefillPeer,
        prompt: list[int],
        params: SamplingParams,
        blocks: list[int],
        first_block: int,
        deadline: float | None,
    ) -> prefill_pb2.PrefillResponse:
        try:
            await peer.ensure_layout(self.layout_info)
        except LayoutMismatch as e:
            raise GenerateError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        except (TimeoutError, grpc.RpcError) as e:
            self.pool.mark_unhealthy(peer, f"model info failed: {e}")
            raise _PrefillFailed(f"{peer.target}: {e}") from None
        dest = self.receiver.expect(stream.request_id, blocks)
        stream.transfer_id, stream.peer, stream.prefill_done = dest.transfer_id, peer, False
        budget = self.config.prefill_timeout
        if deadline is not None:
            budget = min(budget, max(0.001, deadline - time.monotonic()))
        call = peer.stub.Prefill(
            self._prefill_request(stream, prompt, params, dest, first_block), timeout=budget
        )
        landed = asyncio.ensure_future(
            self.receiver.wait(dest.transfer_id, min(budget, self.config.kv_transfer_timeout))
        )
        peer.load += len(prompt)
        started = time.monotonic()
        try:
            response = await self._await_both(call, landed, stream, peer)
        finally:
            peer.load -= len(prompt)
            if not landed.done():
                landed.cancel()
        stream.prefill_done = True
        self.transfer_log[stream.request_id] = response
        while len(self.transfer_log) > 1024:
            self.transfer_log.popitem(last=False)
        stats = response.stats
        # queued here, then on the prefill node
        stream.queue_seconds = stream.admission_wait + stats.queue_seconds
        stream.prefill_seconds = stats.prefill_seconds
        stream.kv_transfer_seconds = stats.transfer_tail_seconds
        self.metrics.kv_transfer_seconds.observe(time.monotonic() - started)
        self.metrics.kv_transfer_bytes.inc(stats.bytes_sent)
        return response

    async def _await_both(
        self,
        call: aio.UnaryUnaryCall,
        landed: asyncio.Future[object],
        stream: _Stream,
        peer: PrefillPeer,
    ) -> prefill_pb2.PrefillResponse:
        rpc = asyncio.ensure_future(call)
        try:
            await asyncio.wait({rpc, landed}, return_when=asyncio.FIRST_EXCEPTION)
            if landed.done() and landed.exception() is not None:
                raise landed.exception()  # type: ignore[misc]
            response = await rpc
            await landed
            return response
        except grpc.RpcError as e:
            await self._forget_transfer(stream)
            code = e.code()
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                raise GenerateError(code, f"prefill node {peer.target}: {e.details()}") from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and stream.deadline_passed():
                raise GenerateError(
                    code, f"request {stream.request_id} exceeded its deadline during prefill"
                ) from None
            self.pool.mark_unhealthy(peer, f"Prefill failed: {code.name} {e.details()}")
            raise _PrefillFailed(f"{peer.target}: {code.name} {e.details()}") from None
        except TransferTimeout:
            await self._forget_transfer(stream)
            call.cancel()
            self._background(peer.cancel(stream.request_id))
            if stream.deadline_passed():  # the client's deadline, not the node's fault
                raise GenerateError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"request {stream.request_id} exceeded its deadline waiting for its KV",
                ) from None
            # a stalled prefill node (SIGSTOP, wedged) looks like this: stop routing to it
            self.pool.mark_unhealthy(peer, "KV transfer timed out")
            raise _PrefillFailed(
                f"{peer.target}: KV transfer for {stream.request_id} timed out after "
                f"{self.config.kv_transfer_timeout:.1f}s"
            ) from None
        except TransferError as e:
            await self._forget_transfer(stream)
            call.cancel()
            self._background(peer.cancel(stream.request_id))
            self.pool.mark_unhealthy(peer, f"KV transfer failed: {e}")
            raise _PrefillFailed(f"{peer.target}: KV transfer failed: {e}") from None
        finally:
            if not rpc.done():
                rpc.cancel()

    def _background(self, coro: Coroutine[object, object, None]) -> None:
        """Fire-and-forget with a strong reference, so the task is not collected mid-flight."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forget_transfer(self, stream: _Stream) -> None:
        """Cancel the stream's transfer and wait until nothing writes its blocks any more (a
        retry reuses them; the release frees them)."""
        if stream.transfer_id is not None:
            transfer_id, stream.transfer_id = stream.transfer_id, None
            await self.receiver.release(transfer_id, self.config.kv_fence_timeout)

    def _prefill_request(
        self,
        stream: _Stream,
        prompt: list[int],
        params: SamplingParams,
        dest: TransferDestination,
        first_block: int,
    ) -> prefill_pb2.PrefillRequest:
        return prefill_pb2.PrefillRequest(
            request_id=stream.request_id,
            prompt_token_ids=prompt,
            sampling=sampling_to_proto(params),
            seed=params.seed or 0,
            destination=prefill_pb2.KvDestination(
                ucx_address=dest.address,
                transfer_id=dest.transfer_id,
                transfer_token=dest.token,
                block_ids=list(dest.block_ids),
                first_block_index=first_block,
                layout_fingerprint=self.layout_info.fingerprint,
            ),
            layerwise=self.config.layerwise,
        )

    # ---- responses and release ------------------------------------------------------------
    def _response(self, stream: _Stream, delta: TokenDelta) -> generation_pb2.GenerateResponse:
        msg = generation_pb2.GenerateResponse(
            request_id=stream.request_id,
            token_ids=delta.token_ids,
            text=delta.text,
            index=delta.index,
        )
        if delta.logprobs:
            msg.logprobs.extend(logprob_to_proto(lp) for lp in delta.logprobs)
        if delta.prompt_logprobs is not None:
            msg.prompt_logprobs.extend(prompt_logprobs_to_proto(delta.prompt_logprobs))
        if delta.finish_reason is not None:
            msg.finish_reason = _FINISH[delta.finish_reason]
            msg.usage.CopyFrom(
                generation_pb2.Usage(
                    prompt_tokens=stream.prompt_len,
                    completion_tokens=stream.tokens_by_index.get(delta.index, 0),
                    cached_tokens=stream.cached_tokens,
                )
            )
            ttft = (stream.first_token_at or time.monotonic()) - stream.admitted_at
            msg.timing.CopyFrom(
                generation_pb2.Timing(
                    queue_seconds=stream.queue_seconds,
                    prefill_seconds=stream.prefill_seconds,
                    kv_transfer_seconds=stream.kv_transfer_seconds,
                    time_to_first_token_seconds=ttft,
                    e2e_seconds=time.monotonic() - stream.admitted_at,
                )
            )
        return msg

    async def _release(self, stream: _Stream) -> None:
        """Every exit path: cancel the transfer, tell the prefill node, free seat and blocks."""
        rid = stream.request_id
        self.streams.pop(rid, None)
        await self._forget_transfer(stream)
        if stream.peer is not None and not stream.prefill_done:
            self._background(stream.peer.cancel(rid))
        if self.thread is not None:
            release = EngineCore.fail_transfer if stream.failed else EngineCore.abort
            with contextlib.suppress(RuntimeError):
                await self.thread.call(lambda core: release(core, rid))


def _first_token(
    response: prefill_pb2.PrefillResponse, params: SamplingParams
) -> tuple[
    int,
    TokenLogprobs | None,
    list[TokenLogprobs | None] | None,
    list[tuple[int, TokenLogprobs | None]],
]:
    """The prefill node's first token with its logprobs and the prompt's (when asked), and
    the other completions' first tokens (n > 1)."""
    first = None
    if params.logprobs is not None and response.HasField("first_token_logprobs"):
        first = logprob_from_proto(response.first_token_logprobs)
    prompt = None
    if params.prompt_logprobs is not None:
        prompt = prompt_logprobs_from_proto(response.prompt_logprobs)
    tokens = list(response.choice_first_token_ids)
    if len(tokens) != params.n - 1:
        raise GenerateError(
            grpc.StatusCode.INTERNAL,
            f"prefill node returned {len(tokens)} first tokens for n={params.n} completions",
        )
    lps: list[TokenLogprobs | None] = [None] * len(tokens)
    if params.logprobs is not None and len(response.choice_first_token_logprobs) == len(tokens):
        lps = [logprob_from_proto(m) for m in response.choice_first_token_logprobs]
    return response.first_token_id, first, prompt, list(zip(tokens, lps, strict=True))

