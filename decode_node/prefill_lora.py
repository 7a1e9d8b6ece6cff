"""Passing a decode node's runtime LoRA updates on to its prefill nodes.

After the decode node itself has loaded an adapter, every healthy prefill node is asked to load
it from the same path (on its own disk), at once, each within `LORA_RPC_S`; what each then serves
(`LoraAdaptersResponse`) is what routing uses from that moment (decode_node/peers.py). A node that
cannot (started without --allow-runtime-lora, the path missing there, no free slot) keeps
serving without it: the request naming the adapter is routed elsewhere, or prefilled on the
decode node (its local fallback). An unload goes the same way, after the decode node's own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from decode_node.peers import PrefillPeer
from proto.pdserve.v1 import prefill_pb2
from shared.serving.replica_pool import ReplicaPool

LORA_RPC_S = 60.0  # reading a large adapter from a slow disk takes a while
log = logging.getLogger(__name__)

Update = Callable[[PrefillPeer], Awaitable[prefill_pb2.LoraAdaptersResponse]]


async def load_everywhere(pool: ReplicaPool[PrefillPeer], name: str, path: str) -> list[str]:
    """Ask every healthy prefill node to load adapter `name` from `path`; the ones that did not,
    each with why."""
    request = prefill_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
    return await _each(
        pool.replicas,
        f"load {name!r}",
        lambda p: p.stub.LoadLoraAdapter(request, timeout=LORA_RPC_S),
    )


async def unload_everywhere(pool: ReplicaPool[PrefillPeer], name: str) -> list[str]:
    """Routing stops sending `name` to any prefill node at once, then each that may serve it
    unloads it; the ones that could not."""
    holders = [p for p in pool.replicas if p.may_serve(name)]
    for peer in holders:
        if peer.lora_adapters is not None:
            peer.lora_adapters = peer.lora_adapters - {name}
    request = prefill_pb2.UnloadLoraAdapterRequest(lora_name=name)
    return await _each(
        holders,
        f"unload {name!r}",
        lambda p: p.stub.UnloadLoraAdapter(request, timeout=LORA_RPC_S),
        fine=grpc.StatusCode.NOT_FOUND,  # it never had it
    )


async def _each(
    replicas: list[PrefillPeer],
    what: str,
    update: Update,
    fine: grpc.StatusCode | None = None,
) -> list[str]:
    """`update` on every healthy one of `replicas` at once; the ones that failed (a `fine`
    status is no failure), each with why."""
    peers = [p for p in replicas if p.healthy]
    results = await asyncio.gather(*(update(p) for p in peers), return_exceptions=True)
    failures = []
    for peer, result in zip(peers, results, strict=True):
        if isinstance(result, prefill_pb2.LoraAdaptersResponse):
            peer.lora_adapters = frozenset(result.lora_adapters)
            continue
        if isinstance(result, grpc.aio.AioRpcError) and result.code() == fine:
            continue
        why = (
            f"{result.code().name} {result.details()}"
            if isinstance(result, grpc.aio.AioRpcError)
            else repr(result)
        )
        log.warning("prefill node %s did not %s: %s", peer.target, what, why)
        failures.append(f"{peer.target}: {why}")
    return failures
