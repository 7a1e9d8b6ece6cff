"""Prefill peers as the decode node sees them: a replica pool, plus layout agreement.

A peer is one prefill node process, not one address: each process reports a random instance id
(ModelInfo.instance_id, learnt with its model info). When the address answers with another id
(a node killed and restarted there), what was learnt from the old process (layout, limits, push
mode) is dropped and relearnt, and every transfer granted to the old one is failed at once
(`KvReceiver.sender_restarted`: the request is asked again, of any node); its blocks only ever
take KV stamped with the instance they were granted to (`transfer.protocol`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc import aio

from proto.pdserve.v1 import generation_pb2, prefill_pb2, prefill_pb2_grpc
from shared.serving.grpc_server import GRPC_SERVER_OPTIONS, describe_layout_info
from shared.serving.replica_pool import Health, Replica, ReplicaPool, reconnect_options

log = logging.getLogger(__name__)


class LayoutMismatch(Exception):
    pass


@dataclass
class PrefillPeer(Replica):
    """A prefill node; `load` counts the prompt tokens this decode node has outstanding there
    that it predicted uncached there (all of them, unless routing by KV)."""

    stub: prefill_pb2_grpc.PrefillStub = field(default=None)  # type: ignore[assignment]
    layout: generation_pb2.KvLayoutInfo | None = None
    num_kv_blocks: int = 0  # its pool, as it reports it (0: not reported)
    num_offload_blocks: int = 0  # its offload tiers below the pool, as it reports them
    max_context: int = 0  # its max_model_len, as it reports it (0: not reported)
    layerwise: bool | None = None  # the push asked of it (decode_node/push_mode.py); None: not yet
    lora_adapters: frozenset[str] | None = None  # the adapters it serves; None: not learnt yet
    # its process instance (ModelInfo.instance_id) as last learnt; kept across `forget`, so that
    # the next `learn` tells a restarted node from the one that went unhealthy (0: unknown)
    instance_id: int = 0
    restarts: int = 0  # new instances seen on this address
    # told (peer, old instance id) when it answers as a new instance: the decode node fails
    # what it had granted to the old one
    on_new_instance: Callable[[PrefillPeer, int], None] | None = None

    def forget(self) -> None:
        self.layout = None  # a restarted node may come back with another model
        self.layerwise = None
        self.lora_adapters = None

    async def check_health(self, timeout: float) -> Health:
        """Its health and, the first time it serves (again), its model info: the decode node
        knows each prefill node's limits (decode_node/prefill_limits.py) before a request
        needs them."""
        health = await super().check_health(timeout)
        if health is Health.SERVING and self.layout is None:
            with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
                await self.learn(timeout)
        return health

    async def learn(self, timeout: float = 5.0) -> None:
        """Ask its model info: KV layout, pool and context."""
        info = await self.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout)
        self._note_instance(info.instance_id)
        self.num_kv_blocks, self.max_context = info.num_kv_blocks, info.max_context
        self.num_offload_blocks = info.num_offload_blocks
        self.lora_adapters = frozenset(info.lora_adapters)
        self.layout = info.kv_layout  # last: a layout means the limits beside it are known
        log.info(
            "prefill node %s: max_model_len %d, KV pool %d blocks of %d tokens",
            self.target,
            info.max_context,
            info.num_kv_blocks,
            info.kv_layout.block_size,
        )

    def may_serve(self, adapter: str | None) -> bool:
        """Whether it may prefill for `adapter` (None: the base model): as far as is known,
        a node not learnt yet is asked, and refuses if it lacks it."""
        return adapter is None or self.lora_adapters is None or adapter in self.lora_adapters

    def _note_instance(self, instance_id: int) -> None:
        """Record the instance it answers as; a new one is a new peer (module docstring)."""
        old, self.instance_id = self.instance_id, instance_id
        if not old or instance_id == old:
            return
        self.restarts += 1
        log.warning(
            "prefill node %s is a new instance (%#x, was %#x): what was learnt from the old one "
            "and the transfers granted to it are dropped",
            self.target,
            instance_id,
            old,
        )
        if self.on_new_instance is not None:
            self.on_new_instance(self, old)

    async def ensure_layout(self, mine: generation_pb2.KvLayoutInfo) -> None:
        if self.layout is None:
            await self.learn()
        assert self.layout is not None
        if self.layout.fingerprint != mine.fingerprint:
            raise LayoutMismatch(
                f"KV layout mismatch with prefill node {self.target}: decode has "
                f"{describe_layout_info(mine)}, prefill has {describe_layout_info(self.layout)}"
            )

    async def cancel(self, request_id: str) -> None:
        with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
            await self.stub.CancelPrefill(
                prefill_pb2.CancelPrefillRequest(request_id=request_id), timeout=2.0
            )


def prefill_pool(
    targets: tuple[str, ...],
    health_interval: float,
    credentials: grpc.ChannelCredentials | None = None,
    on_new_instance: Callable[[PrefillPeer, int], None] | None = None,
) -> ReplicaPool[PrefillPeer]:
    def connect(target: str, host: str) -> PrefillPeer:
        # a vanished replica (container removed: packets dropped, no RST) would otherwise hold
        # a dial for gRPC's 20 s minimum connect timeout before the retry goes elsewhere
        options = [
            *GRPC_SERVER_OPTIONS,
            ("grpc.min_reconnect_backoff_ms", 2000),
            *reconnect_options(health_interval),
        ]
        if credentials is None:
            channel = aio.insecure_channel(target, options=options)
        else:
            # we dial the resolved address, but the certificate names the configured host
            options.append(("grpc.ssl_target_name_override", host))
            channel = aio.secure_channel(target, credentials, options=options)
        stub = prefill_pb2_grpc.PrefillStub(channel)
        return PrefillPeer(target, host, channel, stub=stub, on_new_instance=on_new_instance)

    return ReplicaPool("prefill node", targets, health_interval, connect)
