"""The prefill node: context-only requests in, KV pushed over UCX, first token out.

A `Prefill` call is admitted into the continuous batch (chunked prefill, own prefix cache). As each
layer of a chunk is computed, the finished blocks of that layer are pinned and pushed, straight from
the pool, to the decode node's reserved blocks while the next layer computes. The seat goes back
when the last chunk is computed; the blocks stay pinned until the push completes (and UCX no longer
reads them), then remain in the prefix cache. A push still incomplete at the decode node's
deadline is given up and released by the node itself (prefill_node/job_table.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

import grpc
from prometheus_client import Counter

from prefill_node import lora_rpc
from prefill_node.config import PrefillNodeConfig
from prefill_node.embedding_landing import EmbeddingLanding
from prefill_node.encoders import EncoderClients
from prefill_node.job import FINAL, PrefillJob
from prefill_node.job_table import JobFailed, JobTable
from prefill_node.outcome import counted_prefill
from prefill_node.push import make_layer_hook, plan_push
from prefill_node.tracing import traced_prefill
from proto.pdserve.v1 import generation_pb2, prefill_pb2, prefill_pb2_grpc
from shared.engine.commands import AddRequest, ContextPushed, Shutdown
from shared.engine.connector.kv_push import KvAccess
from shared.engine.core import EngineCore
from shared.engine.errors import RequestRejected, ResourcesExhausted
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import LlmRequest
from shared.engine.roles.prefill_role import PrefillSettings
from shared.engine.sampling.grammar_compiler import compile_async
from shared.engine.scheduling.scheduler import ScheduledRequest
from shared.engine.thread import EngineThread
from shared.model import attention_timing, native
from shared.model.loader import LoadedModel
from shared.serving.grpc_server import NodeMetrics, NodeServing, model_info, new_instance_id
from shared.serving.limits import PUSH_QUIESCE_S
from shared.serving.metrics import prompt_tokens_counter
from shared.serving.offload_metrics import register_offload_metrics
from shared.serving.request_outcomes import PREFILL_OUTCOMES, RequestOutcomes
from shared.serving.wire import (
    WireError,
    check_request_id,
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
)
from shared.serving.wire_destination import destination_from_proto
from shared.serving.wire_images import images_from_proto
from transfer import protocol
from transfer.errors import retrieve_exception
from transfer.sender import SEND_WINDOW
from transfer.ucx import KvMessage, KvPush, KvSender, TransferError

log = logging.getLogger(__name__)
SERVICE_DESCRIPTOR = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"]
SERVICE = SERVICE_DESCRIPTOR.full_name


class PrefillNode(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, config: PrefillNodeConfig, loaded: LoadedModel | None = None):
        config.validate()
        self.config = config
        # driven only through commands on self.thread; read only through self.info
        settings = PrefillSettings(
            layer_hooks=self._layer_hook,
            offload=config.offload(),
            offload_stats=config.offload_stats,
        )
        self.core = EngineCore(config.engine, loaded, role=settings)
        self.info = self.core.info
        self.layout = self.info.layout
        self.sender = KvSender(self.layout, instance_id=new_instance_id())
        self.thread: EngineThread | None = None
        self.metrics = NodeMetrics(lambda: self._snapshot())
        self.prompt_tokens = prompt_tokens_counter(self.metrics.registry)
        if config.kv_offload_cpu_gb:
            register_offload_metrics(self.metrics.registry, config.offload_stats)
        self.outcomes = RequestOutcomes(self.metrics.requests_total, PREFILL_OUTCOMES)
        expired = Counter(
            "pdserve_kv_transfers_expired",
            "KV pushes still incomplete at their deadline (the decode node's): given up, "
            "their blocks unpinned, their requests ended DISAGG_TRANS_ERROR",
            registry=self.metrics.registry,
        )
        self.jobs = JobTable(self._release, expired)  # read by the layer hook too
        self.serving: NodeServing | None = None
        self.port = 0
        self.encoders: EncoderClients | None = None  # opened at start, on the serving loop
        if config.encoder_targets and self.info.loaded.config.vision is None:
            raise ValueError(f"--encoder: {self.info.loaded.name} is a text model")

    def _snapshot(self):
        assert self.thread is not None
        return self.thread.snapshot

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # attention's path for each kind, timed on this CPU at the first start, then cached;
        # before the engine thread runs a forward
        info = self.info
        attention_timing.establish(info.loaded.config, info.kv_pool.dtype, info.device_type)
        # a crashed engine (a bug) turns health NOT_SERVING: decode nodes route elsewhere, and
        # the prefills it held are answered UNAVAILABLE at once (their pushes end)
        self.thread = EngineThread(
            self.core, loop, self._on_deltas, "prefill-engine", on_crash=self._not_serving
        )
        await self.thread.start_warm()
        native.log_states()  # each C kernel on (variant, path) or off and why
        self.sender.start(self.info.kv_pool.device)  # not inside the first request's push
        vision = self.info.loaded.config.vision
        if self.config.encoder_targets and vision is not None:
            hidden = self.info.loaded.config.hidden_size
            c = self.config
            landing = EmbeddingLanding(
                hidden, c.encoder_landing_bytes, c.ucx_host, c.ucx_port, c.kv_bind_host
            )
            await landing.start()
            tls = None if c.encoder_tls is None else c.encoder_tls.credentials()
            self.encoders = EncoderClients(
                c.encoder_targets,
                hidden,
                vision.spatial_merge_size,
                landing,
                tls,
                self.metrics.registry,
            )
        self.serving = await NodeServing.serve(
            self, SERVICE_DESCRIPTOR, self.config, self.metrics.registry
        )
        self.port = self.serving.port
        log.info("prefill node serving on %s:%d", self.config.host, self.port)

    async def stop(self, grace: float = 5.0) -> bool:
        """Stop admitting, finish or abort in-flight work within `grace`, release everything;
        returns whether every seat and block was back in its pool."""
        if self.serving is not None:
            await self.serving.stop_admitting(grace)
        for job in self.jobs.values():
            job.cancelled = True
        conserved = True
        if self.thread is not None:
            conserved = self.thread.fatal_error is None and await self.thread.call(Shutdown())
            self.thread.stop()
        self.jobs.close()
        await self.sender.close()
        if self.encoders is not None:
            await self.encoders.close()
        if self.serving is not None:
            await self.serving.close_metrics()
        return conserved

    def _not_serving(self, error: BaseException) -> None:
        if self.serving is not None:
            self.serving.not_serving()
        self.jobs.fail_all(f"the prefill node's engine stopped: {error!r}")

    # ---- engine thread side ---------------------------------------------------------------
    def _layer_hook(self, scheduled: Sequence[ScheduledRequest], kv: KvAccess):
        work = plan_push(scheduled, self.jobs, kv.block_table, self.layout.block_size)
        return make_layer_hook(work, self.info.kv_pool, self.layout.num_layers, kv.pin_blocks)

    def _on_deltas(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            job = self.jobs.get(delta.request_id)
            if job is not None and not job.first_token.done():
                job.first_token.set_result(delta)

    # ---- RPCs -----------------------------------------------------------------------------
    async def GetModelInfo(self, request, context):
        return model_info(self.info, generation_pb2.NODE_ROLE_PREFILL, self.sender.instance_id)

    async def LoadLoraAdapter(self, request, context):
        assert self.thread is not None
        allowed = self.config.allow_runtime_lora
        return await lora_rpc.load(self.thread, self.info, allowed, request, context)

    async def UnloadLoraAdapter(self, request, context):
        assert self.thread is not None
        allowed = self.config.allow_runtime_lora
        return await lora_rpc.unload(self.thread, self.info, allowed, request, context)

    async def CancelPrefill(self, request, context):
        found = self.jobs.cancel(request.request_id)
        return prefill_pb2.CancelPrefillResponse(found=found)

    @counted_prefill
    @traced_prefill
    async def Prefill(self, request, context):
        rid = request.request_id
        dest = request.destination
        if dest.layout_fingerprint != self.layout.fingerprint():
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV layout mismatch: decode node has fingerprint {dest.layout_fingerprint}, "
                f"this prefill node has {self.layout.fingerprint()} ({self.layout.describe()})",
            )
        if dest.prefill_instance_id not in (0, self.sender.instance_id):
            await context.abort(  # the decode node knew this node's predecessor: it relearns
                grpc.StatusCode.ABORTED, f"blocks granted to instance {dest.prefill_instance_id:#x}"
            )
        if self.thread is not None and self.thread.fatal_error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill node's engine stopped")
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        try:
            check_request_id(rid)
        except WireError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if rid in self.jobs:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id {rid!r} is already in flight here"
            )
        if len(self.jobs) >= self.config.max_pending:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"prefill node has {len(self.jobs)} requests pending (max_pending); retry",
            )
        time_left = await self._time_left(request, context)
        try:
            job = self._new_job(request, time_left)
        except ValueError as e:  # a malformed TransferDestination (address, id, token)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"destination: {e}")
        try:
            return await self.jobs.run(job, self._run(job, request))
        except RequestRejected as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ResourcesExhausted as e:  # no grammar compile worker free, or no room for it
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except TimeoutError as e:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {rid}: {e}")
        except JobFailed as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill of {rid}: {e}")
        except TransferError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV push for {rid} failed: {e}")
        finally:
            # The release (UCX done reading the blocks, then the engine unpins and forgets the
            # request) is the job table's own task: the RPC's cancellation cannot stop it half
            # way. A pushed request's answer does not wait for it: the engine takes the release
            # between two steps, and the first token would wait out the next step, a whole
            # prefill of other prompts (up to 0.9 s measured at 2 req/s of 1k-token prompts).
            # A failed one waits (shielded), so that a retry finds its request id free here.
            release = self.jobs.release(job)
            if job.pushed:
                release.add_done_callback(retrieve_exception)
            else:
                await asyncio.shield(release)

    async def _time_left(self, request: prefill_pb2.PrefillRequest, context) -> float:
        """Seconds the push has: the earliest of the call's gRPC deadline, the decode node's
        `deadline_unix` (when it stops waiting for the KV) and the node's default."""
        deadline = request.deadline_unix
        if not (math.isfinite(deadline) and deadline >= 0):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"deadline_unix must be a finite Unix time or 0 (none), got {deadline}",
            )
        left = [self.config.default_timeout]
        if (remaining := context.time_remaining()) is not None:
            left.append(remaining)
        if deadline:
            left.append(deadline - time.time())
        if min(left) <= 0:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the deadline of {request.request_id} passed before it reached this node",
            )
        return min(left)

    def _new_job(self, request: prefill_pb2.PrefillRequest, time_left: float) -> PrefillJob:
        d = request.destination
        destination = destination_from_proto(d)
        loop = asyncio.get_running_loop()
        job = PrefillJob(
            request.request_id, destination, d.first_block_index, request.layerwise, loop
        )
        job.task = asyncio.current_task()
        self.jobs.add(job, time_left)
        return job

    async def _run(
        self, job: PrefillJob, request: prefill_pb2.PrefillRequest
    ) -> prefill_pb2.PrefillResponse:
        assert self.thread is not None
        params = sampling_from_proto(request.sampling, seed=request.seed)
        prompt = list(request.prompt_token_ids)
        try:
            images = images_from_proto(request.images, self.info.loaded.image_processor)
        except WireError as e:
            raise RequestRejected(str(e)) from None
        if self.encoders is not None:
            images = await self.encoders.encode(job.request_id, images)
        job.check_destination(len(prompt), self.layout.block_size, self.layout.num_layers)
        # in a compile worker, stopped when the job's deadline cancels this task; invalid:
        # INVALID_ARGUMENT, no worker free in time: RESOURCE_EXHAUSTED
        if params.structured is not None:
            await compile_async(self.info.tokenizer, self.info.vocab_size, params.structured)
        # the delta rides in the KV headers: known before the first layer is pushed
        layout = self.info.multimodal(prompt, images)
        delta = 0 if layout is None else layout.delta
        job.push = push = self.sender.open(job.destination, self.info.kv_pool, delta)
        req = await self.thread.call(AddRequest(prompt, params, job.request_id, images))
        sent_bytes, messages = await self._drain(job, push)
        job.sent = True
        first = await job.first_token
        job.completed = True
        if first.error is not None:  # pushed and released as any other; the client's error
            raise RequestRejected(f"request {job.request_id}: {first.error}")
        stats = self._stats(job, sent_bytes, messages, req)
        self.metrics.queue_seconds.observe(stats.queue_seconds)
        self.prompt_tokens.labels(source="computed").inc(len(prompt) - req.cached_tokens)
        self.prompt_tokens.labels(source="cached").inc(req.cached_tokens)
        response = prefill_pb2.PrefillResponse(
            request_id=job.request_id,
            first_token_id=first.token_ids[0],
            cached_tokens=req.cached_tokens,
            stats=stats,
            instance_id=self.sender.instance_id,
            mrope_delta=req.mrope_delta,  # for decode nodes that predate the header's
        )
        if first.logprobs:
            response.first_token_logprobs.CopyFrom(logprob_to_proto(first.logprobs[0]))
        if first.prompt_logprobs is not None:
            response.prompt_logprobs.extend(prompt_logprobs_to_proto(first.prompt_logprobs))
        # n > 1: set on the engine thread before the first token's delta was posted
        for token, logprobs in req.choice_first_tokens:
            response.choice_first_token_ids.append(token)
            if logprobs is not None:
                response.choice_first_token_logprobs.append(logprob_to_proto(logprobs))
        return response

    async def _drain(self, job: PrefillJob, push: KvPush) -> tuple[int, int]:
        """Send the request's messages as the layer hook queues them, up to SEND_WINDOW in
        flight (the receiver lands them in any order); messages for consecutive layers of the
        same blocks that are already queued go as one. Returns once all were taken."""
        sent = messages = 0
        in_flight: deque[asyncio.Future[int]] = deque()
        backlog: deque[KvMessage | None] = deque()
        try:
            while True:
                if not backlog:
                    backlog.append(await job.queue.get())
                while not job.queue.empty():
                    backlog.append(job.queue.get_nowait())
                item = backlog.popleft()
                if item is FINAL:
                    break
                while backlog and _continues(item, backlog[0]):
                    item = replace(item, n_layers=item.n_layers + 1)
                    backlog.popleft()
                if job.first_message_at is None:
                    job.first_message_at = time.time()
                in_flight.append(self._post(push, item))
                while len(in_flight) >= SEND_WINDOW or (in_flight and in_flight[0].done()):
                    sent += await in_flight.popleft()
                    messages += 1
            while in_flight:
                sent += await in_flight.popleft()
                messages += 1
        finally:
            for fut in in_flight:
                fut.add_done_callback(retrieve_exception)
        return sent, messages

    def _post(self, push: KvPush, item: KvMessage) -> asyncio.Future[int]:
        fut = push.post(item)
        header = protocol.header_size(len(item.blocks))
        fut.add_done_callback(
            lambda f: (
                f.cancelled()
                or f.exception() is not None
                or self.metrics.kv_transfer_bytes.inc(f.result() + header)
            )
        )
        return fut

    def _stats(
        self, job: PrefillJob, sent: int, messages: int, request: LlmRequest
    ) -> prefill_pb2.TransferStats:
        now_wall, now = time.time(), time.monotonic()
        scheduled = request.first_scheduled_time or job.admitted_at
        # stamped on the engine thread when the last chunk's forward and sample finished: the
        # end of prefill compute (the layer hook fires before the last layer's attention/MLP)
        computed = request.first_token_time or now
        return prefill_pb2.TransferStats(
            bytes_sent=sent,
            messages=messages,
            queue_seconds=max(0.0, scheduled - job.admitted_at),
            prefill_seconds=max(0.0, computed - scheduled),
            transfer_tail_seconds=max(0.0, now - computed),
            first_layer_sent_unix=job.first_message_at or 0.0,
            last_layer_computed_unix=now_wall - (now - computed),
            last_byte_sent_unix=now_wall,
        )

    async def _release(self, job: PrefillJob) -> None:
        """Whatever happened (pushed, failed, cancelled, expired): nothing more is sent, and once
        UCX no longer reads the request's blocks (bounded wait) the engine unpins and forgets
        it. Runs as the job table's task, never cut short by the RPC's cancellation."""
        ok = job.pushed
        job.cancelled = True
        if job.work is not None:
            job.work.cancel()  # no-op once it finished
        if job.push is not None:
            await job.push.quiesce(PUSH_QUIESCE_S)
        if self.thread is not None:
            # the job holds its request id until this returns, so the id is still this job's
            with contextlib.suppress(RuntimeError):  # the engine is stopping: it releases all
                await self.thread.call(ContextPushed(job.request_id, ok))


def _continues(first: KvMessage, nxt: KvMessage | None) -> bool:
    """Whether `nxt` extends `first` to one more consecutive layer of the same blocks, read
    from the pool (packed CUDA payloads go one by one)."""
    return (
        nxt is not None
        and first.src is not None
        and nxt.src is not None
        and nxt.layer == first.layer + first.n_layers
        and list(nxt.src) == list(first.src)
        and list(nxt.blocks) == list(first.blocks)
    )
