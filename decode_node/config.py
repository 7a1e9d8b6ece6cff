"""Decode node configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.config import EngineConfig
from shared.serving.tls import ClientTls, ServerTls
from transfer.protocol import resolve_bind_address


@dataclass(frozen=True)
class DecodeNodeConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    prefill_targets: tuple[str, ...] = ()  # host:port of every prefill node
    host: str = "127.0.0.1"
    port: int = 50051
    ucx_host: str = "127.0.0.1"  # the transfer plane's address, advertised to prefill nodes
    ucx_port: int = 0
    ucx_bind_host: str | None = None  # the KV listener binds here; None: ucx_host
    metrics_port: int = -1  # -1: no metrics endpoint, 0: an ephemeral port
    max_inflight: int = 256  # requests past the admission queue at once (blocks reserved)
    # requests waiting, holding nothing, for blocks or an inflight slot; past it
    # RESOURCE_EXHAUSTED with a retry hint (0: refuse whatever cannot be admitted at once)
    max_queued: int = 1024
    kv_transfer_timeout: float = 30.0  # from prefill dispatch to the last KV byte placed
    # after a transfer ends, how long a payload write still posted into its blocks (sender
    # stalled mid-message) may hold them before every KV endpoint is force-closed to end it
    kv_fence_timeout: float = 5.0
    prefill_timeout: float = 60.0  # the Prefill RPC, queueing on the prefill node included
    prefill_retries: int = 1  # re-dispatches to another healthy prefill node after a failure
    health_check_interval: float = 2.0
    layerwise: bool = True  # push each layer as it is computed (False: whole request at the end)
    tls: ServerTls | None = None  # the public endpoint; None: plaintext
    prefill_tls: ClientTls | None = None  # how to reach prefill nodes; None: plaintext

    @property
    def kv_bind_host(self) -> str:
        return self.ucx_host if self.ucx_bind_host is None else self.ucx_bind_host

    def validate(self) -> None:
        self.engine.validate()
        if not self.prefill_targets:
            raise ValueError(
                "a decode node needs at least one prefill target (--prefill HOST:PORT)"
            )
        for target in self.prefill_targets:
            host, sep, port = target.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"prefill target {target!r} is not HOST:PORT")
        for name in ("port", "ucx_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        try:
            resolve_bind_address(self.kv_bind_host)
        except ValueError as e:
            raise ValueError(f"--ucx-bind / --ucx-host: {e}") from None
        if self.metrics_port < -1 or self.metrics_port > 65535:
            raise ValueError(f"metrics_port must be -1 (off) or a port, got {self.metrics_port}")
        for name in (
            "kv_transfer_timeout",
            "kv_fence_timeout",
            "prefill_timeout",
            "health_check_interval",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for tls in (self.tls, self.prefill_tls):
            if tls is not None:
                tls.validate()
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.prefill_retries < 0:
            raise ValueError(f"prefill_retries must be >= 0, got {self.prefill_retries}")
