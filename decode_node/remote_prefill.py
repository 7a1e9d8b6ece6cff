"""Remote prefill dispatch: the prompt goes to a healthy prefill node with the destination of
the blocks this node reserved for it; the KV lands layer by layer through the receiver while the
`Prefill` RPC runs, and the first token (sampled there) comes back in the RPC's response."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine

import grpc
from grpc import aio

from decode_node.config import DecodeNodeConfig
from decode_node.kv_router import PrefixIndex, prefill_cost
from decode_node.peers import LayoutMismatch, PrefillPeer
from decode_node.prefill_answer import FirstTokens, first_tokens
from decode_node.push_mode import pushes_layerwise
from decode_node.stream import PrefillFailed, Stream
from decode_node.tracing import PrefillAttempt
from proto.pdserve.v1 import generation_pb2, prefill_pb2
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.scheduling.transfer_admission import TransferGrant
from shared.model.kv_window import skipped_blocks
from shared.serving.grpc_server import GenerateError, NodeMetrics
from shared.serving.limits import MAX_REQUEST_ID_CHARS
from shared.serving.replica_pool import ReplicaPool
from shared.serving.status import Status
from shared.serving.wire import sampling_to_proto
from shared.serving.wire_destination import destination_to_proto
from shared.serving.wire_images import images_to_proto
from transfer.errors import TransferSenderRestarted
from transfer.protocol import TransferDestination
from transfer.ucx import (
    KvReceiver,
    TransferError,
    TransferReset,
    TransferStats,
    TransferTimeout,
)

log = logging.getLogger(__name__)

# Re-asks, beyond --prefill-retries, after this node's KV receiver reset a transfer (a stalled
# write ended by force, a listener restart): the prefill node was not at fault.
_RESET_RETRIES = 2


class RemotePrefill:
    def __init__(
        self,
        config: DecodeNodeConfig,
        pool: ReplicaPool[PrefillPeer],
        receiver: KvReceiver,
        metrics: NodeMetrics,
        layout: generation_pb2.KvLayoutInfo,
        kv_device_type: str,  # where this node's KV pool is: "cpu", "cuda"
        windows: tuple[int | None, ...] = (),  # per layer, for a window-aware transfer
    ):
        self.config = config
        self.windows = windows
        self.kv_on_cpu = kv_device_type == "cpu"
        self.pool = pool
        self.receiver = receiver
        self.metrics = metrics
        self.layout_info = layout
        self._tasks: set[asyncio.Future[None]] = set()
        self.index = PrefixIndex()  # what each prefill node likely holds (kv routing)
        self._instances: dict[str, int] = {}  # the instance the index learnt each node as
        # PrefillResponse of recent requests (timestamps, bytes): the layer-wise evidence
        self.transfer_log: OrderedDict[str, prefill_pb2.PrefillResponse] = OrderedDict()

    async def prefill(
        self,
        stream: Stream,
        prompt: list[int],
        params: SamplingParams,
        grant: TransferGrant,
        hashes: list[bytes],
    ) -> FirstTokens:
        """Try healthy prefill nodes (1 + prefill_retries of them) until one fills the granted
        blocks; returns the first tokens. Raises PrefillFailed when none could. `hashes`: the
        prompt's full-block hashes (prompt_hashes, at this node's block size, the layout's)."""
        # a node known to lack the request's adapter is not asked
        tried = {p.target for p in self.pool.replicas if not p.may_serve(params.lora_adapter)}
        last_error = "every prefill node is marked unhealthy (failing health checks)"
        if tried and all(p.target in tried for p in self.pool.replicas if p.healthy):
            last_error = f"no healthy prefill node has LoRA adapter {params.lora_adapter!r}"
        block = self.layout_info.block_size
        usable = hashes[: (len(prompt) - 1) // block]  # the last token is always computed
        attempts, resets = 1 + self.config.prefill_retries, 0
        while attempts > 0:
            peer = self.pool.pick(tried, self._cost(prompt, usable, tried))
            if peer is None:
                break
            tried.add(peer.target)
            stream.prefill_id = attempt_id(stream.request_id, resets)
            predicted = self._predicted_blocks(peer, usable)
            try:
                response, landed = await self._prefill_once(
                    stream, peer, prompt, params, grant, len(prompt) - predicted * block
                )
            except PrefillFailed as e:
                last_error = str(e)
                if not e.node_at_fault and resets < _RESET_RETRIES:
                    resets += 1  # not the node's doing: it may be asked again, uncounted
                    tried.discard(peer.target)
                else:
                    attempts -= 1
                continue
            self.index.correct(peer.target, usable, response.cached_tokens // block)
            self.index.record(peer.target, hashes)
            return first_tokens(response, params, landed.mrope_delta)
        raise PrefillFailed(last_error)

    def _predicted_blocks(self, peer: PrefillPeer, usable: list[bytes]) -> int:
        if self.config.prefill_routing != "kv":
            return 0
        return self.index.matched_blocks(peer.target, usable)

    def _cost(
        self, prompt: list[int], usable: list[bytes], tried: set[str]
    ) -> Callable[[PrefillPeer], float]:
        """How `--prefill-routing` ranks the healthy nodes (ties rotate in the pool)."""
        mode = self.config.prefill_routing
        if mode == "round-robin":
            return lambda peer: 0.0
        if mode == "least-loaded":
            return lambda peer: float(peer.load)
        block = self.layout_info.block_size
        hits = {
            p.target: self.index.matched_blocks(p.target, usable) * block
            for p in self.pool.replicas
            if p.healthy and p.target not in tried
        }
        best = max(hits.values(), default=0)

        def kv(peer: PrefillPeer) -> float:
            return prefill_cost(len(prompt), hits.get(peer.target, 0), peer.load, best)

        return kv

    def _layerwise(self, peer: PrefillPeer) -> bool:
        if peer.layerwise is None:
            peer.layerwise = pushes_layerwise(self.config.push, peer.target, self.kv_on_cpu)
            log.info(
                "prefill node %s: %s KV push (--push %s)",
                peer.target,
                "layer-wise" if peer.layerwise else "whole-request",
                self.config.push,
            )
        return peer.layerwise

    def _mark_unhealthy(self, peer: PrefillPeer, why: str) -> None:
        self.pool.mark_unhealthy(peer, why)
        self.index.forget_node(peer.target)  # it may come back restarted, its cache empty

    async def _prefill_once(
        self,
        stream: Stream,
        peer: PrefillPeer,
        prompt: list[int],
        params: SamplingParams,
        grant: TransferGrant,
        load: int,
    ) -> tuple[prefill_pb2.PrefillResponse, TransferStats]:
        """One Prefill RPC to `peer`, counting `load` (its predicted uncached tokens) there: its
        answer and what landed."""
        await self._check_layout(peer)
        self._follow_instance(peer)
        budget = self.config.prefill_timeout
        if stream.deadline is not None:
            budget = min(budget, max(0.001, stream.deadline - time.monotonic()))
        # the lease: the blocks are granted to this instance of the node for at most this long,
        # from now, whatever it does (docs/deployment.md, "Instance ids and the KV lease")
        kv_budget = min(budget, self.config.kv_transfer_timeout)
        skipped = self._skipped(len(prompt), grant)
        dest = self.receiver.expect(
            stream.request_id,
            grant.blocks,
            skipped=skipped,
            sender=peer.instance_id,
            lease=kv_budget,
        )
        stream.transfer_id, stream.peer, stream.prefill_done = dest.transfer_id, peer, False
        request = self._prefill_request(stream, prompt, params, dest, grant.first_block)
        request.layerwise = self._layerwise(peer)
        # when this node stops waiting for the KV: the prefill node gives the push up then too
        request.deadline_unix = time.time() + kv_budget
        trace = PrefillAttempt.start(self.config, stream, peer, request, load)
        call = peer.stub.Prefill(request, timeout=budget, metadata=trace.metadata)
        landed = asyncio.ensure_future(self.receiver.wait(dest.transfer_id, kv_budget))
        trace.watch(landed)
        # what the node holds: its pool, and the tiers below it that load a prefix back
        held = peer.num_kv_blocks + peer.num_offload_blocks if peer.num_kv_blocks else 0
        self.index.set_capacity(peer.target, held)
        peer.load += load
        started = time.monotonic()
        try:
            response, stats = await self._await_both(
                call, landed, stream, peer, dest.sender_instance
            )
        except BaseException as e:
            trace.fail(e)
            raise
        finally:
            peer.load -= load
            if not landed.done():
                landed.cancel()
        trace.done(response)
        self._record(stream, response, started)
        return response, stats

    async def _check_layout(self, peer: PrefillPeer) -> None:
        """`peer` serves this node's KV layout (its model info, asked once per instance)."""
        try:
            await peer.ensure_layout(self.layout_info)
        except LayoutMismatch as e:
            raise GenerateError(Status.FAILED_PRECONDITION, str(e)) from None
        except (TimeoutError, grpc.RpcError) as e:
            self._mark_unhealthy(peer, f"model info failed: {e}")
            raise PrefillFailed(f"{peer.target}: {e}") from None

    def _follow_instance(self, peer: PrefillPeer) -> None:
        """A new instance of the node holds none of its predecessor's prefixes."""
        if self._instances.get(peer.target, peer.instance_id) != peer.instance_id:
            self.index.forget_node(peer.target)
        self._instances[peer.target] = peer.instance_id

    def _skipped(self, prompt_len: int, grant: TransferGrant) -> tuple[int, ...]:
        """Per layer, the granted blocks the prefill node leaves out (empty: none); the engine
        keeps them out of the prefix cache (set before the transfer, read after it lands)."""
        if not self.windows:
            return ()
        block = self.layout_info.block_size
        skipped = skipped_blocks(self.windows, prompt_len, block, grant.first_block)
        grant.request.partial_blocks = tuple(grant.blocks[: max(skipped, default=0)])
        return skipped

    def _record(
        self, stream: Stream, response: prefill_pb2.PrefillResponse, started: float
    ) -> None:
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

    async def _await_both(
        self,
        call: aio.UnaryUnaryCall,
        landed: asyncio.Future[TransferStats],
        stream: Stream,
        peer: PrefillPeer,
        granted: int,
    ) -> tuple[prefill_pb2.PrefillResponse, TransferStats]:
        """The Prefill answer once its KV has landed, with what landed; a failure of either ends
        both (cleanly: the transfer released, the prefill node told) as a PrefillFailed or
        GenerateError."""
        rpc = asyncio.ensure_future(call)
        try:
            await asyncio.wait({rpc, landed}, return_when=asyncio.FIRST_EXCEPTION)
            if landed.done() and landed.exception() is not None:
                raise landed.exception()  # type: ignore[misc]
            response = await rpc
            if response.instance_id not in (0, granted):  # another process answered
                peer.forget()  # its model info is relearnt (and the change seen) next time
                raise TransferSenderRestarted(f"answered by instance {response.instance_id:#x}")
            return response, await landed
        except grpc.RpcError as e:
            await self.forget_transfer(stream)
            raise self._rpc_failure(e, stream, peer) from None
        except (TransferTimeout, TransferError) as e:
            await self.forget_transfer(stream)
            call.cancel()
            self.background(peer.cancel(stream.prefill_id))
            raise self._transfer_failure(e, stream, peer) from None
        finally:
            if not rpc.done():
                rpc.cancel()

    def _rpc_failure(self, e: grpc.RpcError, stream: Stream, peer: PrefillPeer) -> Exception:
        code = e.code()
        if code == grpc.StatusCode.ABORTED:  # the blocks were granted to its predecessor
            peer.forget()  # relearnt on the next ask, which the new instance is not at fault for
            return PrefillFailed(f"{peer.target}: {e.details()}", node_at_fault=False)
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            return GenerateError(Status[code.name], f"prefill node {peer.target}: {e.details()}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and stream.deadline_passed():
            return GenerateError(
                Status.DEADLINE_EXCEEDED,
                f"request {stream.request_id} exceeded its deadline during prefill",
            )
        self._mark_unhealthy(peer, f"Prefill failed: {code.name} {e.details()}")
        return PrefillFailed(f"{peer.target}: {code.name} {e.details()}")

    def _transfer_failure(self, e: Exception, stream: Stream, peer: PrefillPeer) -> Exception:
        if isinstance(e, TransferReset):  # this node's doing: the prefill node stays healthy
            return PrefillFailed(f"{peer.target}: {e}", node_at_fault=False)
        if not isinstance(e, TransferTimeout):  # TransferTimeout is a TransferError too
            self._mark_unhealthy(peer, f"KV transfer failed: {e}")
            return PrefillFailed(f"{peer.target}: KV transfer failed: {e}")
        if stream.deadline_passed():  # the client's deadline, not the node's fault
            return GenerateError(
                Status.DEADLINE_EXCEEDED,
                f"request {stream.request_id} exceeded its deadline waiting for its KV",
            )
        # a stalled prefill node (SIGSTOP, wedged) looks like this: stop routing to it
        self._mark_unhealthy(peer, "KV transfer timed out")
        log.warning("%s: %s (receiver: %s)", peer.target, e, self.receiver.describe())
        return PrefillFailed(f"{peer.target}: {e}")

    def background(self, coro: Coroutine[object, object, None]) -> None:
        """Fire-and-forget with a strong reference, so the task is not collected mid-flight."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def forget_transfer(self, stream: Stream) -> None:
        """Cancel the stream's transfer and wait until nothing writes its blocks any more (a
        retry reuses them; the release frees them)."""
        if stream.transfer_id is not None:
            transfer_id, stream.transfer_id = stream.transfer_id, None
            await self.receiver.release(transfer_id, self.config.kv_fence_timeout)

    async def release(self, stream: Stream) -> None:
        """The request ended: its transfer cancelled, the prefill node told if still busy."""
        await self.forget_transfer(stream)
        if stream.peer is not None and not stream.prefill_done:
            self.background(stream.peer.cancel(stream.prefill_id))

    def _prefill_request(
        self,
        stream: Stream,
        prompt: list[int],
        params: SamplingParams,
        dest: TransferDestination,
        first_block: int,
    ) -> prefill_pb2.PrefillRequest:
        return prefill_pb2.PrefillRequest(
            request_id=stream.prefill_id,
            prompt_token_ids=prompt,
            sampling=sampling_to_proto(params),
            seed=params.seed or 0,
            destination=destination_to_proto(dest, first_block),
            images=images_to_proto(stream.images),
        )


def attempt_id(request_id: str, resets: int) -> str:
    """The Prefill request id after `resets` re-asks: a prefill node may still hold an abandoned
    attempt under the plain id (until its push quiesces, up to 5 s), and ids are unique there."""
    if resets == 0:
        return request_id
    suffix = f"#{resets}"
    return request_id[: MAX_REQUEST_ID_CHARS - len(suffix)] + suffix
