"""The decode node: the public front door (and, with `colocated`, a colocated node: the same
node with no prefill nodes, every prompt prefilled by its own engine).

One request path (`DecodeNode.generate`, for gRPC and HTTP alike):
1. **local prefill** (decided by the engine, shared/engine/scheduling/placement.py): a prompt that,
after
   this node's own prefix-cache hit, leaves at most `local_prefill_tokens` to compute while the
   engine's step budget has room (or `local_prefill_idle_tokens` while the engine is idle), is
   added to the engine's scheduler (QUEUED -> CONTEXT_INIT -> decode);
2. otherwise **remote prefill** (decode_node/remote_prefill.py): the request waits QUEUED
   (holding nothing) in the engine's admission queue until the blocks for its prompt and first
   token are free (by priority, aged; bounded by max_queued; its deadline kept), is admitted in
   DISAGG_GENERATION_INIT (blocks reserved and pinned, no seat), dispatched to a healthy
   prefill node with the destination of those blocks (DISAGG_GENERATION_TRANS_IN_PROGRESS), and
   once every layer of every block has landed becomes DISAGG_GENERATION_TRANS_COMPLETE: the
   first token (sampled by the prefill node) is streamed the moment the Prefill RPC returns
   (decode_node/first_token.py), and the next iteration seats and decodes it in the
   continuous batch;
3. **fallback**: no prefill node could serve it -> prefilled here (`local_prefill_fallback`);
4. the deltas are streamed (decode_node/responses.py) and, on every exit, the request is
   released on both nodes.
Every wait has a deadline enforced by the event loop's timers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from decode_node import prefill_limits, prefill_lora
from decode_node.config import DecodeNodeConfig
from decode_node.first_token import engine_took_first, release_first
from decode_node.grammar_check import with_grammar
from decode_node.health import decode_health
from decode_node.remote_prefill import RemotePrefill
from decode_node.request_images import request_images, widen
from decode_node.responses import generate_response
from decode_node.startup import build_parts
from decode_node.stream import PrefillFailed, Stream
from decode_node.tracing import traced_generate
from decode_node.ttft_report import observe_ttft
from proto.pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.engine.commands import Abort, Command, Drain, PlacePrompt, Shutdown, TransferFailed
from shared.engine.core import EngineCore
from shared.engine.errors import RequestRejected, ResourcesExhausted
from shared.engine.events import Admitted
from shared.engine.info import EngineInfo
from shared.engine.requests.multimodal import PromptImage
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import FinishReason
from shared.engine.resources.block_manager import BlockHash, compute_block_hashes
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.scheduling.transfer_admission import AdmissionClosed, TransferGrant
from shared.engine.thread import EngineThread
from shared.model.kv_window import layer_windows
from shared.model.loader import LoadedModel
from shared.serving import lora_admin
from shared.serving.grpc_server import GenerateError, NodeServing, layout_info, model_info
from shared.serving.http import serve_http_api
from shared.serving.metrics import AsgiServer
from shared.serving.request_outcomes import DECODE_OUTCOMES, RequestOutcomes
from shared.serving.status import Status
from shared.serving.wire import (
    WireError,
    continue_answer,
    generate_params_from_proto,
    validate_request,
)

log = logging.getLogger(__name__)
SERVICE_DESCRIPTOR = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
SERVICE = SERVICE_DESCRIPTOR.full_name


class DecodeNode(generation_pb2_grpc.GenerationServicer):
    def __init__(self, config: DecodeNodeConfig, loaded: LoadedModel | None = None):
        config.validate()
        self.config = config
        self.slo = config.slo_policy()  # shared with the engine's admission (thread-safe)
        # driven only through commands on self.thread; read only through self.info
        self.core = EngineCore(config.engine, loaded, role=config.decode_settings(self.slo))
        self.engine_info = self.core.info  # `info` is it with the context served
        self.layout_info = layout_info(self.engine_info.layout)
        self.streams: dict[str, Stream] = {}
        self.thread: EngineThread | None = None
        parts = build_parts(config, self.engine_info, lambda: self._snapshot())
        self.receiver, self.pool, self.metrics = parts.receiver, parts.pool, parts.metrics
        self.counters = parts.counters
        self.outcomes = RequestOutcomes(self.metrics.requests_total, DECODE_OUTCOMES)
        windows = layer_windows(self.info.loaded.config) if config.window_aware_transfer else ()
        self.remote = RemotePrefill(
            config,
            self.pool,
            self.receiver,
            self.metrics,
            self.layout_info,
            self.info.device_type,
            windows,
        )
        self.serving: NodeServing | None = None
        self.http: AsgiServer | None = None
        self.port, self.accepting = 0, True

    @property
    def info(self) -> EngineInfo:
        """The engine's facts, `max_model_len` no more than the prefill nodes take (what
        /v1/models, /tokenizer_info and GetModelInfo report)."""
        return prefill_limits.served(self.engine_info, self._prefill_limit())

    def _prefill_limit(self) -> prefill_limits.PrefillLimit | None:
        if self.config.colocated:
            return None
        return prefill_limits.tightest(self.pool.replicas, self.layout_info.fingerprint)

    @property
    def transfer_log(self):
        """PrefillResponse of recent remote prefills (timestamps, bytes)."""
        return self.remote.transfer_log

    def _snapshot(self):
        assert self.thread is not None
        return self.thread.snapshot

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.thread = EngineThread(
            self.core,
            loop,
            self._on_deltas,
            "decode-engine",
            on_event=self._on_event,
            on_crash=self._on_crash,
        )
        await self.thread.start_warm()
        await self.receiver.start()
        await self.pool.start()
        self.serving = await NodeServing.serve(
            self, SERVICE_DESCRIPTOR, self.config, self.metrics.registry
        )
        self.port = self.serving.port
        if self.config.http_port >= 0:
            self.http = await serve_http_api(
                self,
                self.config.http_api(self.info.loaded),
                self.metrics.registry,
                self.config.host,
                self.config.http_port,
                self.config.tls,
            )
        log.info(
            "decode node serving on %s:%d (KV listener %s); max_model_len %d (%s)",
            self.config.host,
            self.port,
            self.receiver.address,
            self.info.max_model_len,
            self._context_source(),
        )

    def _context_source(self) -> str:
        """What limits the context served: a prefill node's pool, or this node's own."""
        limit = self._prefill_limit()
        if limit is not None and limit.context < self.engine_info.max_model_len:
            return f"prefill node {limit.target}: {limit.pool_blocks} KV blocks"
        return "this node's KV pool and the model's context"

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
            conserved = self.thread.fatal_error is None and await self.thread.call(Shutdown())
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
            drained = await self.thread.call(Drain())
            for rid in drained:
                stream = self.streams.get(rid)
                if stream is not None and stream.admission and not stream.admission.done():
                    stream.admission.set_exception(
                        GenerateError(
                            Status.UNAVAILABLE,
                            f"decode node is shutting down; {rid} was still queued and was "
                            "never started: retry on another node",
                        )
                    )

    def _on_event(self, event: object) -> None:
        match event:
            case Admitted(request_id=rid, grant=grant):
                stream = self.streams.get(rid)
                admission = None if stream is None else stream.admission
                if admission is not None and not admission.done():
                    admission.set_result(grant)

    def _on_crash(self, error: BaseException) -> None:
        """The engine thread died (a bug): nothing it held will move again. Health turns
        NOT_SERVING (an orchestrator restarts the node, a router stops sending here) and every
        open request is answered UNAVAILABLE now rather than left waiting."""
        self.accepting = False
        if self.serving is not None:
            self.serving.not_serving()
        for stream in self.streams.values():
            stream.queue.put_nowait(TokenDelta(stream.request_id, [], "", FinishReason.ABORTED))
            if stream.admission is not None and not stream.admission.done():
                stream.admission.set_exception(self._crashed())

    def _crashed(self) -> GenerateError:
        error = self.thread.fatal_error if self.thread is not None else None
        return GenerateError(
            Status.UNAVAILABLE, f"decode engine stopped ({error!r}): retry on another node"
        )

    def _on_deltas(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            stream = self.streams.get(delta.request_id)
            if stream is not None:
                stream.queue.put_nowait(delta)

    # ---- RPCs -----------------------------------------------------------------------------
    async def GetModelInfo(self, request, context):
        colocated = generation_pb2.NODE_ROLE_COLOCATED
        role = colocated if self.config.colocated else generation_pb2.NODE_ROLE_DECODE
        return model_info(self.info, role, self.receiver.instance_id)

    async def Generate(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        try:
            async for response in self._generate(rid, request, context.time_remaining()):
                yield response
        except GenerateError as e:
            await context.abort(e.code.grpc_code, str(e), trailing_metadata=e.trailing_metadata)

    async def _generate(
        self, rid: str, request: generation_pb2.GenerateRequest, time_left: float | None
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        deadline = None if time_left is None else time.monotonic() + time_left
        limits = self.config.image_limits
        images = await asyncio.to_thread(request_images, self.info, request, limits)
        parsed = self._parse(request, images)
        prompt, params = await with_grammar(self.info, *parsed, deadline)
        # closed explicitly: a cancelled call releases the request now, not when collected
        gen = self.generate(rid, prompt, params, deadline, images)
        async with contextlib.aclosing(gen) as gen:
            async for stream, delta in gen:
                yield generate_response(stream, delta)

    # ---- the one request path -------------------------------------------------------------
    @traced_generate
    async def generate(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        deadline: float | None,
        images: Sequence[PromptImage] = (),
    ) -> AsyncIterator[tuple[Stream, TokenDelta]]:
        """The one request path, for gRPC and HTTP alike: prefill (here or on a prefill node),
        stream the deltas; release on both nodes on every exit (finish, error, the consumer
        cancelled or closed). Raises GenerateError with the status to report."""
        if not self.accepting:
            raise self.outcomes.refused(
                GenerateError(Status.UNAVAILABLE, f"decode node is {self.health[1]}")
            )
        if rid in self.streams:
            raise self.outcomes.refused(
                GenerateError(Status.INVALID_ARGUMENT, f"request_id {rid!r} is already in flight")
            )
        stream = Stream(rid, len(prompt), deadline=deadline, n=params.n)
        self.streams[rid] = stream
        error: Status | None = None  # None: finished, or its consumer went away
        try:
            pending = await self._prefill(stream, prompt, params, images)
            while len(stream.finished) < stream.n:
                if not pending and stream.completing is not None:
                    pending = await engine_took_first(stream)
                    continue
                delta = pending.pop(0) if pending else await self._next_delta(stream, deadline)
                if self.thread.fatal_error is not None:
                    raise self._crashed()
                if delta.error is not None:  # the engine ended it; the rest of its batch goes on
                    raise GenerateError(Status.INVALID_ARGUMENT, f"request {rid}: {delta.error}")
                self._first_token_seen(stream)
                stream.account(delta)
                yield stream, delta
        except GenerateError as e:
            stream.failed, error = True, e.code
            raise
        except Exception:
            error = Status.INTERNAL
            raise
        finally:
            self.outcomes.ended(stream.finished.values(), stream.n, error)
            await asyncio.shield(self._release(stream))

    async def _prefill(
        self,
        stream: Stream,
        prompt: list[int],
        params: SamplingParams,
        images: Sequence[PromptImage] = (),
    ) -> list[TokenDelta]:
        """Local when short and there is room (or no prefill node is healthy and fallback is
        on), else remote; returns the first deltas already known (remote: one per completion;
        local: none, they come from the engine's steps)."""
        assert self.thread is not None
        # hashed once, here: the local-prefill check, the prefix cache and the router reuse them
        seed = self.info.kv_seed(params.lora_adapter)  # an adapter's KV is its own
        try:
            multimodal = self.info.multimodal(prompt, images)
        except RequestRejected as e:
            raise GenerateError(Status.INVALID_ARGUMENT, str(e)) from None
        keyed = prompt if multimodal is None else multimodal.hash_token_ids(prompt)
        hashes = compute_block_hashes(keyed, self.info.block_size, seed)
        if multimodal is not None:  # the Prefill call carries them; its answer's delta agrees
            stream.images, stream.mrope_delta = tuple(images), multimodal.delta
        if await self._start(stream, prompt, params, hashes, self._fallback_now(), images):
            return []
        grant = await self._granted(stream)
        stream.cached_tokens = grant.request.cached_tokens
        try:
            first = await self.remote.prefill(stream, prompt, params, grant, hashes)
        except PrefillFailed as e:
            if not self.config.local_prefill_fallback:
                raise GenerateError(
                    Status.UNAVAILABLE,
                    f"no healthy prefill node could serve {stream.request_id}: {e}",
                ) from None
            log.warning("prefilling %s locally: %s", stream.request_id, e)
            await self._start(stream, prompt, params, hashes, True, images)
            return []
        self.counters.remote()
        return await release_first(self.thread, stream, prompt, params, first)

    def _fallback_now(self) -> bool:
        if self.config.colocated:
            return True  # every prompt is prefilled here
        return self.config.local_prefill_fallback and not self.pool.any_healthy()

    async def _start(
        self,
        stream: Stream,
        prompt: list[int],
        params: SamplingParams,
        hashes: list[BlockHash],
        force: bool,
        images: Sequence[PromptImage] = (),
    ) -> bool:
        """One engine command (a loop-engine hand-off, taken between two decode steps): the
        engine prefills the prompt itself if it qualifies (always with `force`), else queues it
        for a transfer, its grant coming on `stream.admission`. Returns whether it went local."""
        if not force:
            stream.admission = asyncio.get_running_loop().create_future()
        rid, deadline = stream.request_id, stream.deadline
        place = PlacePrompt(prompt, params, rid, deadline, hashes, fallback=force, images=images)
        try:
            stream.local = await self._admitting_call(place)
        except AdmissionClosed as e:
            raise GenerateError(Status.UNAVAILABLE, f"decode node: {e}") from None
        return stream.local is not None

    async def _admitting_call(self, command: Command) -> Any:
        """An engine command that may refuse the request: bad input (RequestRejected) is
        INVALID_ARGUMENT, no room (ResourcesExhausted) RESOURCE_EXHAUSTED with its retry hint."""
        assert self.thread is not None
        try:
            return await self.thread.call(command)
        except RequestRejected as e:
            raise GenerateError(Status.INVALID_ARGUMENT, str(e)) from None
        except ResourcesExhausted as e:
            raise GenerateError(Status.RESOURCE_EXHAUSTED, str(e), e.retry_after_s) from None

    def _first_token_seen(self, stream: Stream) -> None:
        if stream.first_token_at is not None:
            return
        stream.first_token_at = time.monotonic()
        ttft = observe_ttft(self.metrics, self.slo, stream)
        if stream.local is not None:
            # written by the engine thread when it scheduled the request, before the first
            # token it sampled reached this loop (call_soon_threadsafe orders the two)
            stream.cached_tokens = stream.local.cached_tokens
            stream.prefill_seconds = ttft
            self.counters.local(stream.prompt_len, stream.cached_tokens)

    def validate(
        self, prompt: list[int], params: SamplingParams, request_id: str = ""
    ) -> SamplingParams:
        """Wire bounds and engine checks before any allocation (gRPC, HTTP); the seed resolved."""
        try:
            validate_request(request_id, params, self.engine_info.vocab_size)
            self.engine_info.validate(prompt, params)
            limit = self._prefill_limit()
            if limit is not None:
                limit.check(len(prompt), params.max_tokens)
        except (WireError, RequestRejected) as e:
            raise self.outcomes.refused(GenerateError(Status.INVALID_ARGUMENT, str(e))) from None
        return params.with_resolved_seed()

    async def load_lora(self, name: str, path: str) -> list[str]:
        assert self.thread is not None
        await lora_admin.load_lora(self.thread, self.info, name, path)
        return await prefill_lora.load_everywhere(self.pool, name, path)

    async def unload_lora(self, name: str) -> list[str]:
        assert self.thread is not None
        await lora_admin.unload_lora(self.thread, name)
        return await prefill_lora.unload_everywhere(self.pool, name)

    @property
    def health(self) -> tuple[bool, str]:
        """Able to serve every request now, and why (HTTP /health; decode_node/health.py)."""
        crashed = None if self.thread is None else self.thread.fatal_error
        return decode_health(self.accepting, self.config, self.pool, crashed)

    async def _next_delta(self, stream: Stream, deadline: float | None) -> TokenDelta:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        prev = time.monotonic()
        try:
            delta = await asyncio.wait_for(stream.queue.get(), timeout)
        except TimeoutError:
            raise GenerateError(
                Status.DEADLINE_EXCEEDED,
                f"request {stream.request_id} exceeded its deadline while decoding",
            ) from None
        self.metrics.itl.observe(time.monotonic() - prev)
        return delta

    def _parse(
        self, request: generation_pb2.GenerateRequest, images: tuple[PromptImage, ...] = ()
    ) -> tuple[list[int], SamplingParams]:
        which = request.WhichOneof("prompt")
        if which == "text":
            if not request.text:
                raise GenerateError(Status.INVALID_ARGUMENT, "prompt text is empty")
            prompt = self.info.tokenizer.encode(request.text)
        elif which == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            raise GenerateError(Status.INVALID_ARGUMENT, "prompt is missing: set text or token_ids")
        prompt = widen(self.info, prompt, images)
        try:
            prompt, params = continue_answer(request, prompt, generate_params_from_proto(request))
        except WireError as e:
            raise GenerateError(Status.INVALID_ARGUMENT, str(e)) from None
        return prompt, self.validate(prompt, params, request.request_id)

    # ---- admission (remote path) ----------------------------------------------------------
    async def _granted(self, stream: Stream) -> TransferGrant:
        """Wait (the deadline kept) until the queued request holds its blocks."""
        assert stream.admission is not None
        timeout = None if stream.deadline is None else max(0.0, stream.deadline - time.monotonic())
        grant = None
        with contextlib.suppress(TimeoutError):
            grant = await asyncio.wait_for(asyncio.shield(stream.admission), timeout)
        if grant is None:
            raise GenerateError(
                Status.DEADLINE_EXCEEDED,
                f"request {stream.request_id} exceeded its deadline while queued for KV blocks "
                f"({time.monotonic() - stream.admitted_at:.2f}s queued)",
            )
        stream.admission_wait = grant.queue_seconds
        self.metrics.queue_seconds.observe(grant.queue_seconds)
        return grant

    # ---- release --------------------------------------------------------------------------
    async def _release(self, stream: Stream) -> None:
        """Every exit path: cancel the transfer, tell the prefill node, free seat and blocks."""
        rid = stream.request_id
        self.streams.pop(rid, None)
        await self.remote.release(stream)
        if self.thread is not None:
            # a failed transfer ends DISAGG_TRANS_ERROR; a local request never had one
            failed = stream.failed and stream.local is None
            release = TransferFailed(rid) if failed else Abort(rid)
            with contextlib.suppress(RuntimeError):
                await self.thread.call(release)
