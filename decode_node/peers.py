"""Prefill peers as the decode node sees them: routing, health, layout agreement."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass, field

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.pdserve.v1 import generation_pb2, prefill_pb2, prefill_pb2_grpc
from shared.serving.grpc_server import GRPC_SERVER_OPTIONS, describe_layout_info

log = logging.getLogger(__name__)


class LayoutMismatch(Exception):
    pass


@dataclass
class PrefillPeer:
    target: str
    channel: aio.Channel
    stub: prefill_pb2_grpc.PrefillStub
    healthy: bool = True
    outstanding_tokens: int = 0
    layout: generation_pb2.KvLayoutInfo | None = None
    failures: int = field(default=0)

    async def ensure_layout(self, mine: generation_pb2.KvLayoutInfo) -> None:
        if self.layout is None:
            info = await self.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=5.0)
            self.layout = info.kv_layout
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

    async def check_health(self) -> bool:
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except (TimeoutError, grpc.RpcError):
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING


async def resolve_targets(targets: tuple[str, ...]) -> dict[str, str]:
    """Every address behind each HOST:PORT (a DNS name of a scaled service has several), mapped
    to the host name it came from (what a TLS certificate names)."""
    loop = asyncio.get_running_loop()
    out: dict[str, str] = {}
    for target in targets:
        host, _, port = target.rpartition(":")
        try:
            infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("cannot resolve prefill target %s: %s", target, e)
            continue
        for family, _, _, _, sockaddr in infos:
            addr = (
                f"[{sockaddr[0]}]:{port}" if family == socket.AF_INET6 else f"{sockaddr[0]}:{port}"
            )
            out.setdefault(addr, host)
    return out


def connect_peer(
    target: str, host: str, credentials: grpc.ChannelCredentials | None = None
) -> PrefillPeer:
    # a vanished replica (container removed: packets dropped, no RST) would otherwise hold a
    # dial for gRPC's 20 s minimum connect timeout before the retry goes elsewhere
    options = [*GRPC_SERVER_OPTIONS, ("grpc.min_reconnect_backoff_ms", 2000)]
    if credentials is None:
        channel = aio.insecure_channel(target, options=options)
    else:
        # we dial the resolved address, but the certificate names the configured host
        options.append(("grpc.ssl_target_name_override", host))
        channel = aio.secure_channel(target, credentials, options=options)
    return PrefillPeer(target, channel, prefill_pb2_grpc.PrefillStub(channel))


class PrefillPool:
    """The prefill nodes behind the configured targets, re-resolved on every health round so
    replicas that come and go behind one DNS name are found and dropped."""

    def __init__(
        self,
        targets: tuple[str, ...],
        health_interval: float,
        credentials: grpc.ChannelCredentials | None = None,
    ):
        self.targets = targets
        self.credentials = credentials
        self.peers: list[PrefillPeer] = []
        self.health_interval = health_interval
        self._task: asyncio.Task[None] | None = None
        self._next = 0

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for peer in self.peers:
            await peer.channel.close()

    async def refresh(self) -> None:
        addresses = await resolve_targets(self.targets)
        known = {p.target for p in self.peers}
        for addr, host in addresses.items():
            if addr not in known:
                log.info("prefill node %s discovered", addr)
                peer = connect_peer(addr, host, self.credentials)
                peer.channel.get_state(try_to_connect=True)  # dial now: `pick` prefers READY
                self.peers.append(peer)
        if not addresses:  # a failed lookup keeps the last known set rather than emptying it
            return
        for peer in [p for p in self.peers if p.target not in addresses]:
            if peer.outstanding_tokens:  # requests still in flight there: just stop routing
                self.mark_unhealthy(peer, "no longer in DNS")
                continue
            log.info("prefill node %s left", peer.target)
            self.peers.remove(peer)
            await peer.channel.close()

    def pick(self, exclude: set[str]) -> PrefillPeer | None:
        """Least outstanding prefill tokens among healthy peers; ties rotate."""
        candidates = [p for p in self.peers if p.healthy and p.target not in exclude]
        if not candidates:
            return None
        ready = [
            p
            for p in candidates
            if p.channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY
        ]
        candidates = ready or candidates  # a live connection beats one that may have to dial
        self._next += 1
        n = len(candidates)
        rotated = [candidates[(i + self._next) % n] for i in range(n)]
        return min(rotated, key=lambda p: p.outstanding_tokens)

    def mark_unhealthy(self, peer: PrefillPeer, why: str) -> None:
        if peer.healthy:
            log.warning("prefill node %s marked unhealthy: %s", peer.target, why)
        peer.healthy = False
        peer.layout = None  # a restarted node may come back with another model

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.refresh()
            for peer in list(self.peers):
                ok = await peer.check_health()
                if ok and not peer.healthy:
                    log.info("prefill node %s is healthy again", peer.target)
                if not ok and peer.healthy:
                    self.mark_unhealthy(peer, "health check failed")
                peer.healthy = ok
