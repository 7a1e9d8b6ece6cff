"""Pieces both node roles share: gRPC server set-up, model info, node metrics."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.pdserve.v1 import generation_pb2
from shared.engine.core import EngineCore
from shared.engine.kv_cache import KvLayout
from shared.engine.sampling_params import SamplingParams
from shared.engine.thread import EngineSnapshot
from shared.serving.metrics import LATENCY_BUCKETS, MetricsRegistry, MetricsServer, serve_metrics
from shared.serving.tls import ServerTls

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


def layout_info(layout: KvLayout) -> generation_pb2.KvLayoutInfo:
    return generation_pb2.KvLayoutInfo(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=layout.dtype,
        fingerprint=layout.fingerprint(),
    )


def describe_layout_info(info: generation_pb2.KvLayoutInfo) -> str:
    return (
        f"layers={info.num_layers} kv_heads={info.num_kv_heads} head_dim={info.head_dim} "
        f"block_size={info.block_size} dtype={info.dtype}"
    )


def model_info(core: EngineCore, role: int) -> generation_pb2.ModelInfo:
    return generation_pb2.ModelInfo(
        name=core.loaded.name,
        architecture=core.model_config.architecture,
        vocab_size=core.model_config.vocab_size,
        max_context=core.max_model_len,
        block_size=core.config.block_size,
        node_role=role,
        kv_layout=layout_info(core.layout),
    )


def sampling_from_proto(
    s: generation_pb2.SamplingParams, seed: int | None = None
) -> SamplingParams:
    """The wire's sampling fields (top_p 0 = off); `seed` overrides the message's own."""
    if seed is None and s.HasField("seed"):
        seed = s.seed
    return SamplingParams.from_wire(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=seed,
        stop=tuple(s.stop),
        ignore_eos=s.ignore_eos,
    )


def sampling_to_proto(params: SamplingParams) -> generation_pb2.SamplingParams:
    msg = generation_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def create_grpc_server(
    services: Sequence[str],
    add_servicers: Callable[[aio.Server], None],
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[aio.Server, health.HealthServicer, int]:
    """A grpc.aio server with health checking and reflection; returns (server, health, port)."""
    server = aio.server(options=GRPC_SERVER_OPTIONS)
    add_servicers(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, credentials)
        if credentials is not None
        else server.add_insecure_port(address)
    )
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    return server, health_servicer, bound


def set_serving(health_servicer: health.HealthServicer, services: Sequence[str], ok: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", *services):
        health_servicer.set(name, status)


@dataclass
class NodeServing:
    """A node's public face: gRPC server (with health and reflection) and /metrics."""

    server: aio.Server
    health: health.HealthServicer
    port: int
    services: list[str]
    metrics_server: MetricsServer | None

    @classmethod
    async def start(
        cls,
        services: list[str],
        add_servicers: Callable[[aio.Server], None],
        host: str,
        port: int,
        tls: ServerTls | None,
        registry: MetricsRegistry,
        metrics_port: int,
    ) -> NodeServing:
        credentials = None if tls is None else tls.credentials()
        server, health_servicer, bound = create_grpc_server(
            services, add_servicers, host, port, credentials
        )
        await server.start()
        metrics_server = None
        if metrics_port >= 0:
            metrics_server = await serve_metrics(registry, host, metrics_port)
        set_serving(health_servicer, services, True)
        return cls(server, health_servicer, bound, services, metrics_server)

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_server is None else self.metrics_server.port

    async def stop_admitting(self, grace: float) -> None:
        """Health says NOT_SERVING at once; in-flight RPCs get `grace` seconds to finish."""
        set_serving(self.health, self.services, False)
        await self.server.stop(grace)

    async def close_metrics(self) -> None:
        if self.metrics_server is not None:
            await self.metrics_server.close()


class NodeMetrics:
    """The metrics every node exports; engine gauges read the engine loop's latest snapshot."""

    def __init__(
        self,
        snapshot: Callable[[], EngineSnapshot],
        rejected: Callable[[], float] = lambda: 0.0,
    ):
        self.registry = MetricsRegistry()
        r = self.registry
        r.gauge(
            "pdserve_seats_in_use", "Seats (seq slots) held", fn=lambda: snapshot().seats_in_use
        )
        r.gauge("pdserve_seats_total", "Seat pool size", fn=lambda: snapshot().seats_total)
        r.gauge(
            "pdserve_kv_blocks_in_use",
            "KV blocks referenced or pinned",
            fn=lambda: snapshot().blocks_in_use,
        )
        r.gauge("pdserve_kv_blocks_total", "KV pool size", fn=lambda: snapshot().blocks_total)
        r.gauge(
            "pdserve_kv_blocks_pinned",
            "KV blocks pinned by an in-flight transfer",
            fn=lambda: snapshot().blocks_pinned,
        )
        r.gauge(
            "pdserve_kv_blocks_cached",
            "KV blocks published in the prefix cache",
            fn=lambda: snapshot().blocks_cached,
        )
        r.gauge(
            "pdserve_requests",
            "Live requests by state",
            labelnames=("state",),
            fn=lambda: {(k,): v for k, v in snapshot().requests_by_state.items()},
        )
        self.kv_transfer_seconds = r.histogram(
            "pdserve_kv_transfer_seconds", "KV transfer time per request", LATENCY_BUCKETS
        )
        self.kv_transfer_bytes = r.counter(
            "pdserve_kv_transfer_bytes_total", "KV bytes moved over UCX"
        )
        r.callback_counter(
            "pdserve_kv_transfer_rejected_total",
            "KV messages dropped by validation (bad token, ids, sizes, late), never written",
            rejected,
        )
        self.ttft = r.histogram(
            "pdserve_time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS
        )
        self.itl = r.histogram(
            "pdserve_inter_token_latency_seconds", "Time between streamed tokens", LATENCY_BUCKETS
        )
        self.queue_seconds = r.histogram(
            "pdserve_queue_seconds",
            "Time a request waited, holding nothing, for KV blocks (admission queue)",
            LATENCY_BUCKETS,
        )
        r.callback_counter(
            "pdserve_preemptions_total",
            "Requests preempted (full release, re-queued for recompute) when blocks ran out",
            lambda: float(snapshot().preemptions),
        )
        self.requests_total = r.counter(
            "pdserve_requests_total", "Finished requests by outcome", labelnames=("outcome",)
        )
