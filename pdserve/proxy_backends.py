"""The proxy's decode replicas: one gRPC channel each, in a `ReplicaPool` that follows DNS and
health, each replica telling the router (pdserve/prefix_router.py) when to forget its cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from grpc import aio

from shared.serving.limits import GRPC_CHANNEL_OPTIONS
from shared.serving.replica_pool import Replica, ReplicaPool, reconnect_options

# A backend that vanished with its address (a removed container) answers a connection attempt
# with nothing at all; gRPC's default 20 s connect timeout would hold every call sent there
# that long before it could be retried elsewhere. Backends sit on the same network: 2 s is ample.
CONNECT_TIMEOUT_MS = 2000
CHANNEL_OPTIONS = [*GRPC_CHANNEL_OPTIONS, ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS)]


@dataclass
class Backend(Replica):
    on_forget: Callable[[str], None] = field(default=lambda target: None)

    def forget(self) -> None:
        self.on_forget(self.target)  # the router's view of its prefix cache


def backend_pool(
    targets: Sequence[str],
    health_interval: float,
    forget: Callable[[str], None] = lambda target: None,
) -> ReplicaPool[Backend]:
    """The decode replicas; `load` counts the calls in flight on each. A new backend gets calls
    only once a health round has seen it serving; `forget(target)` runs when one is marked
    unhealthy or leaves."""

    def connect(target: str, host: str) -> Backend:
        options = [*CHANNEL_OPTIONS, *reconnect_options(health_interval)]
        channel = aio.insecure_channel(target, options=options)
        return Backend(target, host, channel, healthy=False, on_forget=forget)

    return ReplicaPool("backend", targets, health_interval, connect, fall_back_to_unhealthy=True)
