"""One pool of gRPC replicas behind DNS names: resolve, refresh, health, least-loaded pick.

Used for decode -> prefill routing and proxy -> decode routing. Targets are HOST:PORT; a DNS
name stands for every address behind it and is re-resolved every health round, so replicas of
a scaled service are found as they come and dropped as they go (once nothing is in flight on
them). The load measure is the caller's: outstanding prefill tokens, calls in flight, ...
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

# A replica whose health check goes unanswered in time this many rounds running is marked
# unhealthy; one refusing it (down, draining) at once. A busy replica (its event loop behind a
# long step, a loaded machine) can miss one answer without being dropped from routing.
SLOW_CHECKS_TO_UNHEALTHY = 2


class Health(enum.Enum):
    SERVING = "serving"
    SLOW = "no answer in time"
    DOWN = "health check failed"


@dataclass
class Replica:
    target: str  # the resolved address dialled
    host: str  # the name it came from (what a TLS certificate names)
    channel: aio.Channel
    healthy: bool = True
    load: int = 0  # the pool's load measure; the owner keeps it current
    slow_checks: int = 0  # health checks unanswered in time, rounds running

    def forget(self) -> None:
        """Drop what was learnt about the replica when it goes unhealthy (it may come back as
        another build); nothing by default."""

    @property
    def connected(self) -> bool:
        return self.channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY

    async def check_health(self, timeout: float) -> Health:
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except TimeoutError:
            return Health.SLOW
        except grpc.RpcError as e:
            slow = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
            return Health.SLOW if slow else Health.DOWN
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            return Health.SERVING
        return Health.DOWN


R = TypeVar("R", bound=Replica)


def reconnect_options(health_interval: float) -> list[tuple[str, int]]:
    """gRPC channel options that keep a lost replica's redial within half a health interval.

    gRPC redials a lost connection with exponential backoff (1 s, growing 1.6x per failed try
    up to 2 min) whatever the health checks say, and a check between dials fails without
    dialling: a replica back on its address after a minute away stayed unhealthy for most of
    another minute. A redial that is refused costs next to nothing.
    """
    cap_ms = max(100, int(health_interval * 500))
    return [
        ("grpc.initial_reconnect_backoff_ms", min(500, cap_ms)),
        ("grpc.max_reconnect_backoff_ms", cap_ms),
    ]


async def resolve_targets(targets: Sequence[str]) -> dict[str, str] | None:
    """Every address behind each HOST:PORT, mapped to the host name it came from; None when no
    name resolved at all (a DNS hiccup must not empty the pool)."""
    loop = asyncio.get_running_loop()
    out: dict[str, str] = {}
    resolved_any = False
    for target in targets:
        host, _, port = target.rpartition(":")
        host = host.strip("[]")
        try:
            infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("cannot resolve %s: %s", target, e)
            continue
        resolved_any = True
        for family, _, _, _, sockaddr in infos:
            v6 = family == socket.AF_INET6
            out.setdefault(f"[{sockaddr[0]}]:{port}" if v6 else f"{sockaddr[0]}:{port}", host)
    return out if resolved_any else None


class ReplicaPool(Generic[R]):
    """The replicas behind `targets`. `connect(address, host)` makes a replica (it owns the
    channel); `pick` returns the least-loaded healthy one not yet tried, ties rotating."""

    def __init__(
        self,
        kind: str,
        targets: Sequence[str],
        health_interval: float,
        connect: Callable[[str, str], R],
        *,
        fall_back_to_unhealthy: bool = False,
    ):
        self.kind = kind  # "prefill node", "backend": for logs
        self.targets = tuple(targets)
        self.health_interval = health_interval
        self.connect = connect
        # the proxy would rather try a replica its health view calls down than refuse a call
        self.fall_back_to_unhealthy = fall_back_to_unhealthy
        self.replicas: list[R] = []
        self._next = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for replica in self.replicas:
            await replica.channel.close()
        self.replicas.clear()

    async def refresh(self) -> None:
        """Re-resolve the targets, add and drop replicas, health-check all of them."""
        addresses = await resolve_targets(self.targets)
        if addresses is not None:
            await self._follow_dns(addresses)
        timeout = max(0.2, min(1.0, self.health_interval / 2))
        results = await asyncio.gather(*(r.check_health(timeout) for r in self.replicas))
        for replica, health in zip(list(self.replicas), results, strict=True):
            replica.slow_checks = replica.slow_checks + 1 if health is Health.SLOW else 0
            if health is Health.SERVING:
                if not replica.healthy:
                    log.info("%s %s is healthy", self.kind, replica.target)
                replica.healthy = True
            elif health is Health.DOWN or replica.slow_checks >= SLOW_CHECKS_TO_UNHEALTHY:
                self.mark_unhealthy(replica, health.value)

    async def _follow_dns(self, addresses: dict[str, str]) -> None:
        known = {r.target for r in self.replicas}
        for addr, host in addresses.items():
            if addr not in known:
                log.info("%s %s discovered", self.kind, addr)
                replica = self.connect(addr, host)
                replica.channel.get_state(try_to_connect=True)  # dial now: `pick` prefers READY
                self.replicas.append(replica)
        for replica in [r for r in self.replicas if r.target not in addresses]:
            if replica.load:  # work still in flight there: just stop routing to it
                self.mark_unhealthy(replica, "no longer in DNS")
                continue
            log.info("%s %s left", self.kind, replica.target)
            replica.forget()
            self.replicas.remove(replica)
            await replica.channel.close()

    def candidates(self, exclude: set[str]) -> list[R]:
        """Healthy replicas not yet tried, those with a live connection first (a dropped
        connection is seen before the next health round)."""
        fresh = [r for r in self.replicas if r.target not in exclude]
        healthy = [r for r in fresh if r.healthy]
        if not healthy and self.fall_back_to_unhealthy:
            return fresh
        return [r for r in healthy if r.connected] or healthy

    def pick(self, exclude: set[str], cost: Callable[[R], float] | None = None) -> R | None:
        """The cheapest candidate by `cost` (default: its load); ties rotate."""
        candidates = self.candidates(exclude)
        if not candidates:
            return None
        self._next += 1
        n = len(candidates)
        rotated = [candidates[(i + self._next) % n] for i in range(n)]
        return min(rotated, key=cost or (lambda r: r.load))

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)

    def mark_unhealthy(self, replica: R, why: str) -> None:
        if replica.healthy:
            log.warning("%s %s marked unhealthy: %s", self.kind, replica.target, why)
        replica.healthy = False
        replica.forget()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.refresh()
