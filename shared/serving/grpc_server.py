"""Pieces both node roles share: gRPC server set-up, model info, node metrics."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from proto.pdserve.v1 import generation_pb2
from shared.engine.info import EngineInfo
from shared.engine.runtime import cpu_threads
from shared.engine.thread import EngineSnapshot
from shared.kv.layout import KvLayout
from shared.serving import tracing
from shared.serving.limits import GRPC_CHANNEL_OPTIONS
from shared.serving.metrics import (
    LATENCY_BUCKETS,
    AsgiServer,
    metrics_app,
    register_scrape_counter,
    register_scrape_gauge,
)
from shared.serving.port_in_use import check_port_free
from shared.serving.reflection import enable_reflection
from shared.serving.status import Status
from shared.serving.tls import ServerTls

log = logging.getLogger(__name__)

GRPC_SERVER_OPTIONS = [*GRPC_CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]


class GenerateError(Exception):
    """A generation request failed; `code` is the status to report (HTTP maps it to its own),
    `retry_after_s` a hint for refusals (gRPC trailing metadata "retry-after", HTTP
    Retry-After)."""

    def __init__(self, code: Status, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self.retry_after_s is None else (("retry-after", str(self.retry_after_s)),)


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


def new_instance_id() -> int:
    """A node process's instance id (ModelInfo.instance_id): random, nonzero, 64 bits, drawn
    once at start, so that a node restarted on the same address is told from its predecessor."""
    while not (instance_id := secrets.randbits(64)):
        pass
    return instance_id


def model_info(info: EngineInfo, role: int, instance_id: int = 0) -> generation_pb2.ModelInfo:
    return generation_pb2.ModelInfo(
        name=info.loaded.name,
        architecture=info.architecture,
        vocab_size=info.vocab_size,
        max_context=info.max_model_len,
        block_size=info.block_size,
        node_role=role,
        kv_layout=layout_info(info.layout),
        num_kv_blocks=info.num_kv_blocks,
        num_offload_blocks=info.num_offload_blocks,
        instance_id=instance_id,
        lora_adapters=sorted(info.lora_adapters),
        image_placeholder=image_placeholder(info),
    )


def image_placeholder(info: EngineInfo) -> str:
    """The text of the model's image placeholder token; "" for a text model."""
    token = info.loaded.config.image_token_id
    return "" if token is None else info.tokenizer.decode([token], skip_special_tokens=False)


def create_grpc_server(
    services: Sequence[str],
    add_servicers: Callable[[aio.Server], None],
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[aio.Server, health.HealthServicer, int]:
    """A grpc.aio server with health checking and reflection (v1 and v1alpha); returns
    (server, health, port)."""
    server = aio.server(options=GRPC_SERVER_OPTIONS, interceptors=tracing.server_interceptors())
    add_servicers(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    enable_reflection(names, server)
    address = f"{host}:{port}"
    try:
        bound = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError:  # gRPC's "Failed to bind", without the reason: found below
        bound = 0
    if bound == 0:
        check_port_free("grpc", host, port)
        raise OSError(f"cannot bind gRPC server to {address}")
    return server, health_servicer, bound


def set_serving(health_servicer: health.HealthServicer, services: Sequence[str], ok: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", *services):
        health_servicer.set(name, status)


class NodeAddress(Protocol):
    """What a node's config says about where it serves (prefill and decode configs alike)."""

    host: str
    port: int
    tls: ServerTls | None
    metrics_port: int


@dataclass
class NodeServing:
    """A node's public face: gRPC server (with health and reflection) and /metrics + /health."""

    server: aio.Server
    health: health.HealthServicer
    port: int
    services: list[str]
    metrics_server: AsgiServer | None
    serving: bool = True

    @classmethod
    async def start(
        cls,
        services: list[str],
        add_servicers: Callable[[aio.Server], None],
        host: str,
        port: int,
        tls: ServerTls | None,
        registry: CollectorRegistry,
        metrics_port: int,
    ) -> NodeServing:
        credentials = None if tls is None else tls.credentials()
        server, health_servicer, bound = create_grpc_server(
            services, add_servicers, host, port, credentials
        )
        await server.start()
        node = cls(server, health_servicer, bound, services, None)
        if metrics_port >= 0:
            app = metrics_app(registry, lambda: node.serving)
            node.metrics_server = await AsgiServer.start(app, host, metrics_port, service="metrics")
        set_serving(health_servicer, services, True)
        return node

    @classmethod
    async def serve(
        cls,
        servicer: object,
        service: ServiceDescriptor,
        node: NodeAddress,
        registry: CollectorRegistry,
    ) -> NodeServing:
        """Serve a node's one service where its config says (host, port, TLS, metrics port)."""
        from shared.serving.wire import add_servicer

        return await cls.start(
            [service.full_name],
            lambda s: add_servicer(s, servicer, service),
            node.host,
            node.port,
            node.tls,
            registry,
            node.metrics_port,
        )

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_server is None else self.metrics_server.port

    def not_serving(self) -> None:
        """Health says NOT_SERVING from now on (gRPC health, /health on the metrics port)."""
        self.serving = False
        set_serving(self.health, self.services, False)

    async def stop_admitting(self, grace: float) -> None:
        """Health says NOT_SERVING at once; in-flight RPCs get `grace` seconds to finish."""
        self.not_serving()
        await self.server.stop(grace)

    async def close_metrics(self) -> None:
        if self.metrics_server is not None:
            await self.metrics_server.close()


# (metric, help, EngineSnapshot field) of the gauges read from the engine's latest snapshot
_SNAPSHOT_GAUGES = (
    ("pdserve_seats_in_use", "Seats (seq slots) held", "seq_slots_in_use"),
    ("pdserve_seats_total", "Seat pool size", "seq_slots_total"),
    ("pdserve_kv_blocks_in_use", "KV blocks referenced or pinned", "blocks_in_use"),
    ("pdserve_kv_blocks_total", "KV pool size", "blocks_total"),
    ("pdserve_kv_blocks_pinned", "KV blocks pinned by an in-flight transfer", "blocks_pinned"),
    ("pdserve_kv_blocks_cached", "KV blocks published in the prefix cache", "blocks_cached"),
)


class NodeMetrics:
    """The metrics every node exports; engine gauges read the engine loop's latest snapshot."""

    def __init__(
        self,
        snapshot: Callable[[], EngineSnapshot],
        rejected: Callable[[], float] = lambda: 0.0,
    ):
        self.registry = r = CollectorRegistry()
        for name, doc, attr in _SNAPSHOT_GAUGES:
            register_scrape_gauge(r, name, doc, lambda attr=attr: getattr(snapshot(), attr))
        register_scrape_gauge(
            r,
            "pdserve_requests",
            "Live requests by state",
            lambda: {(k,): v for k, v in snapshot().requests_by_state.items()},
            labelnames=("state",),
        )
        register_scrape_gauge(
            r, "pdserve_cpu_threads", "Threads of torch and the C kernels", cpu_threads.current
        )
        self.kv_transfer_seconds = self._latency(
            "pdserve_kv_transfer_seconds", "KV transfer time per request"
        )
        self.kv_transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes_total", "KV bytes moved over UCX", registry=r
        )
        register_scrape_counter(
            r,
            "pdserve_kv_transfer_rejected_total",
            "KV messages dropped by validation (bad token, ids, sizes, late), never written",
            rejected,
        )
        self.ttft = self._latency("pdserve_time_to_first_token_seconds", "Time to first token")
        self.itl = self._latency(
            "pdserve_inter_token_latency_seconds", "Time between streamed tokens"
        )
        self.queue_seconds = self._latency(
            "pdserve_queue_seconds",
            "Time a request waited, holding nothing, for KV blocks (admission queue)",
        )
        register_scrape_counter(
            r,
            "pdserve_preemptions_total",
            "Requests preempted (full release, re-queued for recompute) when blocks ran out",
            lambda: float(snapshot().preemptions),
        )
        _speculative_counters(r, snapshot)
        self.requests_total = Counter(
            "pdserve_requests_total",
            "Finished requests by outcome",
            labelnames=("outcome",),
            registry=r,
        )

    def _latency(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)


def _speculative_counters(r: CollectorRegistry, snapshot: Callable[[], EngineSnapshot]) -> None:
    """pdserve_spec_*_total: speculative decoding's drafts, as the engine counts them."""
    for field, doc in (
        ("drafts_proposed", "Speculative draft tokens proposed"),
        ("drafts_accepted", "Speculative draft tokens accepted"),
        ("draft_steps", "A request's speculative (verifying) steps"),
        ("draft_step_tokens", "Tokens those steps yielded (accepted drafts + 1 each)"),
    ):
        register_scrape_counter(
            r,
            f"pdserve_spec_{field}_total",
            doc,
            lambda field=field: float(getattr(snapshot(), field)),
        )
