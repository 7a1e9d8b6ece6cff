"""The prefill node: context-only requests in, KV pushed over UCX, first token out.

A `Prefill` call is admitted into the continuous batch (chunked prefill, own prefix cache). As each
layer of a chunk is computed, the finished blocks of that layer are pinned and pushed, straight from
the pool, to the decode node's reserved blocks while the next layer computes. The seat goes back
when the last chunk is computed; the blocks stay pinned until the push completes (and UCX no longer
reads them), then remain in the prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import grpc

from prefill_node.config import PrefillNodeConfig
from prefill_node.push import FINAL, LayerMessage, PushState, make_layer_hook, plan_push
from proto.pdserve.v1 import generation_pb2, prefill_pb2, prefill_pb2_grpc
from shared.engine.core import EngineCore, RequestRejected
from shared.engine.output import TokenDelta
from shared.engine.request import LlmRequest, LlmRequestState
from shared.engine.scheduler import ScheduledRequest
from shared.engine.thread import EngineThread
from shared.serving.grpc_server import NodeMetrics, NodeServing, model_info, sampling_from_proto
from transfer import protocol as proto
from transfer.errors import retrieve_exception
from transfer.protocol import TransferDestination
from transfer.sender import SEND_WINDOW
from transfer.ucx import KvSender, TransferError

log = logging.getLogger(__name__)
SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
_QUIESCE_S = 5.0  # how long a finished request waits for UCX to stop reading its blocks


class _Pending:
    """What the RPC handler waits on: the first token (engine) and the push (sender task)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.first_token: asyncio.Future[int] = loop.create_future()
        self.admitted_at = time.monotonic()


class PrefillNode(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, config: PrefillNodeConfig, core: EngineCore | None = None):
        config.validate()
        self.config = config
        self.core = core or EngineCore(config.engine, context_only=True)
        if not self.core.context_only:
            raise ValueError("a prefill node needs an EngineCore built with context_only=True")
        self.layout = self.core.layout
        self.pushes: dict[str, PushState] = {}
        self.pending: dict[str, _Pending] = {}
        self.tasks: dict[str, asyncio.Task[object]] = {}
        self.sender = KvSender(self.layout)
        self.thread: EngineThread | None = None
        self.metrics = NodeMetrics(lambda: self._snapshot())
        self.serving: NodeServing | None = None
        self.port = 0

    def _snapshot(self):
        assert self.thread is not None
        return self.thread.snapshot

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.thread = EngineThread(self.core, loop, self._on_deltas, name="prefill-engine")
        self.core.layer_hook_factory = self._layer_hook
        self.thread.start()
        self.serving = await NodeServing.start(
            [SERVICE],
            lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(self, s),
            self.config.host,
            self.config.port,
            self.config.tls,
            self.metrics.registry,
            self.config.metrics_port,
        )
        self.port = self.serving.port
        log.info("prefill node serving on %s:%d", self.config.host, self.port)

    async def stop(self, grace: float = 5.0) -> bool:
        """Stop admitting, finish or abort in-flight work within `grace`, release everything;
        returns whether every seat and block was back in its pool."""
        if self.serving is not None:
            await self.serving.stop_admitting(grace)
        for state in self.pushes.values():
            state.cancelled = True
        conserved = True
        if self.thread is not None:
            conserved = await self.thread.call(lambda core: core.shutdown())
            self.thread.stop()
        await self.sender.close()
        if self.serving is not None:
            await self.serving.close_metrics()
        return conserved

    # ---- engine thread side ---------------------------------------------------------------
    def _layer_hook(self, scheduled: list[ScheduledRequest]):
        work = plan_push(
            scheduled, self.pushes, self.core.kv_manager.block_table, self.layout.block_size
        )
        return make_layer_hook(
            work, self.core.kv_pool, self.layout.num_layers, self.core.kv_manager.pin_blocks
        )

    def _on_deltas(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            pending = self.pending.get(delta.request_id)
            if pending is not None and not pending.first_token.done():
                pending.first_token.set_result(delta.token_ids[0])

    # ---- RPCs -----------------------------------------------------------------------------
    async def GetModelInfo(self, request, context):
        return model_info(self.core, generation_pb2.NODE_ROLE_PREFILL)

    async def CancelPrefill(self, request, context):
        found = await self._cancel(request.request_id)
        return prefill_pb2.CancelPrefillResponse(found=found)

    async def Prefill(self, request, context):
        rid = request.request_id
        dest = request.destination
        if dest.layout_fingerprint != self.layout.fingerprint():
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV layout mismatch: decode node has fingerprint {dest.layout_fingerprint}, "
                f"this prefill node has {self.layout.fingerprint()} ({self.layout.describe()})",
            )
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if rid in self.pending:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id {rid!r} is already in flight here"
            )
        if len(self.pending) >= self.config.max_pending:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"prefill node has {len(self.pending)} requests pending (max_pending); retry",
            )
        timeout = context.time_remaining() or self.config.default_timeout
        task = asyncio.current_task()
        assert task is not None
        self.tasks[rid] = task
        try:
            return await asyncio.wait_for(self._run(request), timeout)
        except RequestRejected as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"prefill of {rid} did not finish within {timeout:.1f}s",
            )
        except TransferError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV push for {rid} failed: {e}")
        finally:
            await self._cleanup(rid)

    async def _run(self, request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        assert self.thread is not None
        rid = request.request_id
        loop = asyncio.get_running_loop()
        params = sampling_from_proto(request.sampling, seed=request.seed)
        d = request.destination
        destination = TransferDestination(
            address=d.ucx_address,
            transfer_id=d.transfer_id,
            token=bytes(d.transfer_token),
            block_ids=tuple(d.block_ids),
            layout_fingerprint=d.layout_fingerprint,
        )
        pending = _Pending(loop)
        self.pending[rid] = pending
        state = PushState(rid, destination, d.first_block_index, request.layerwise, loop)
        self.pushes[rid] = state
        prompt = list(request.prompt_token_ids)
        self._check_destination(prompt, state)
        req = await self.thread.call(lambda core: core.add_request(prompt, params, rid))
        sent_bytes, messages = await self._drain(state)
        first_token = await pending.first_token
        state.completed = True
        stats = self._stats(pending, state, sent_bytes, messages, req)
        return prefill_pb2.PrefillResponse(
            request_id=rid,
            first_token_id=first_token,
            cached_tokens=req.cached_tokens,
            stats=stats,
        )

    def _check_destination(self, prompt: list[int], state: PushState) -> None:
        blocks = -(-len(prompt) // self.layout.block_size)
        want = blocks - state.first_block_index
        if state.first_block_index >= blocks or len(state.destination.block_ids) != want:
            raise RequestRejected(
                f"destination.block_ids has {len(state.destination.block_ids)} blocks from "
                f"first_block_index {state.first_block_index}; a {len(prompt)}-token prompt "
                f"needs {want}"
            )

    async def _drain(self, state: PushState) -> tuple[int, int]:
        """Send the request's messages as the layer hook queues them, up to SEND_WINDOW in
        flight (the receiver lands them in any order); messages for consecutive layers of the
        same blocks that are already queued go as one. Returns once all were taken."""
        sent = messages = 0
        in_flight: deque[asyncio.Future[int]] = deque()
        backlog: deque[LayerMessage | None] = deque()
        try:
            while True:
                if not backlog:
                    backlog.append(await state.queue.get())
                while not state.queue.empty():
                    backlog.append(state.queue.get_nowait())
                item = backlog.popleft()
                if item is FINAL:
                    break
                n_layers = 1
                while backlog and _continues(item, n_layers, backlog[0]):
                    backlog.popleft()
                    n_layers += 1
                if state.first_message_at is None:
                    state.first_message_at = time.time()
                in_flight.append(self._post(state, item, n_layers))
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

    def _post(self, state: PushState, item: LayerMessage, n_layers: int) -> asyncio.Future[int]:
        dest = state.destination
        if item.payload is not None:
            fut = self.sender.post(dest, item.layer, item.dest_block_ids, item.payload)
        else:
            fut = self.sender.post_blocks(
                dest,
                item.layer,
                item.dest_block_ids,
                self.core.kv_pool,
                item.src_block_ids,
                n_layers=n_layers,
            )
        header = proto.header_size(len(item.dest_block_ids))
        fut.add_done_callback(
            lambda f: (
                f.cancelled()
                or f.exception() is not None
                or self.metrics.kv_transfer_bytes.inc(f.result() + header)
            )
        )
        return fut

    def _stats(
        self,
        pending: _Pending,
        state: PushState,
        sent: int,
        messages: int,
        request: LlmRequest,
    ) -> prefill_pb2.TransferStats:
        now_wall, now = time.time(), time.monotonic()
        scheduled = request.first_scheduled_time or pending.admitted_at
        # stamped on the engine thread when the last chunk's forward and sample finished: the
        # end of prefill compute (the layer hook fires before the last layer's attention/MLP)
        computed = request.first_token_time or now
        return prefill_pb2.TransferStats(
            bytes_sent=sent,
            messages=messages,
            queue_seconds=max(0.0, scheduled - pending.admitted_at),
            prefill_seconds=max(0.0, computed - scheduled),
            transfer_tail_seconds=max(0.0, now - computed),
            first_layer_sent_unix=state.first_message_at or 0.0,
            last_layer_computed_unix=now_wall - (now - computed),
            last_byte_sent_unix=now_wall,
        )

    async def _cancel(self, rid: str) -> bool:
        """The decode node gave up on `rid`: stop computing and pushing it; the handler's
        cleanup releases everything."""
        task = self.tasks.get(rid)
        state = self.pushes.get(rid)
        if state is not None:
            state.cancelled = True  # the layer hook stops packing at once
        if task is None:
            return False
        task.cancel()
        return True

    async def _cleanup(self, rid: str) -> None:
        """Whatever happened: the engine forgets the request (unpinning its blocks)."""
        state = self.pushes.pop(rid, None)
        self.pending.pop(rid, None)
        self.tasks.pop(rid, None)
        ok = state is not None and state.completed and not state.cancelled
        if state is not None:
            state.cancelled = True
            # UCX may still read the request's pinned blocks: wait (bounded) before unpinning
            await self.sender.quiesce(state.destination.transfer_id, _QUIESCE_S)
        if self.thread is not None:
            with contextlib.suppress(RuntimeError):
                await self.thread.call(lambda core: _release(core, rid, ok))


def _release(core: EngineCore, rid: str, ok: bool) -> None:
    request = core.requests.get(rid)
    if request is None:
        return
    if request.state == LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
        core.complete_context(rid, ok)
    else:
        core.abort(rid)


def _continues(first: LayerMessage, n_layers: int, nxt: LayerMessage | None) -> bool:
    """Whether `nxt` extends `first` (already n_layers long) to one more consecutive layer of
    the same blocks, read from the pool (packed CUDA payloads go one by one)."""
    return (
        nxt is not None
        and first.payload is None
        and nxt.payload is None
        and nxt.layer == first.layer + n_layers
        and nxt.src_block_ids == first.src_block_ids
        and nxt.dest_block_ids == first.dest_block_ids
    )
