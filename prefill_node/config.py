"""Prefill node configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.config import EngineConfig
from shared.engine.connector.offload import OffloadStats
from shared.engine.connector.offload_config import OffloadConfig
from shared.serving.limits import DRAIN_GRACE_S, PREFILL_DEFAULT_DEADLINE_S
from shared.serving.tls import ClientTls, ServerTls
from transfer.protocol import resolve_bind_address

# A prefill node's step budget: it runs no decode steps whose inter-token latency a big chunk
# would stretch, so prompts up to this long go in one chunk (one fresh-prefill pass: no pool
# gather, fewer steps). Measured on tiny, a 4000-token prompt: 133 ms in one chunk against
# 166 ms in 512-token chunks (docs/performance.md, "Local prefill").
PREFILL_MAX_NUM_TOKENS = 8192


@dataclass(frozen=True)
class PrefillNodeConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 50061
    metrics_port: int = -1  # -1: no metrics endpoint, 0: an ephemeral port
    max_pending: int = 256  # context-only requests queued or in flight before RESOURCE_EXHAUSTED
    default_timeout: float = PREFILL_DEFAULT_DEADLINE_S  # when the caller sets no deadline
    tls: ServerTls | None = None  # None: plaintext gRPC
    drain_grace: float = DRAIN_GRACE_S  # on SIGTERM, for in-flight prefills to finish
    # LoadLoraAdapter / UnloadLoraAdapter, as decode nodes pass their runtime updates on
    allow_runtime_lora: bool = False
    # encoder nodes (E/P/D, --encoder): a prompt's images are encoded there, else here
    encoder_targets: tuple[str, ...] = ()
    encoder_tls: ClientTls | None = None  # how to reach them; None: plaintext
    # where those encoders push embeddings: a UCX listener (as a decode node's for KV) over a
    # landing area of this many bytes
    ucx_host: str = "127.0.0.1"  # advertised to the encoders
    ucx_port: int = 0
    ucx_bind_host: str | None = None  # None: ucx_host
    encoder_landing_bytes: int = 64 << 20
    # KV tiers below the pool (--kv-offload-*: pdserve/cli/offload_args.py)
    kv_offload_cpu_gb: float = 0.0
    kv_offload_disk_dir: str = ""
    kv_offload_disk_gb: float = 0.0
    # what the tiers count (the engine thread writes, /metrics reads)
    offload_stats: OffloadStats = field(default_factory=OffloadStats, compare=False)

    def offload(self) -> OffloadConfig:
        return OffloadConfig.from_gb(
            self.kv_offload_cpu_gb,
            self.kv_offload_disk_dir,
            self.kv_offload_disk_gb,
            self.engine.model,
        )

    @property
    def kv_bind_host(self) -> str:
        return self.ucx_host if self.ucx_bind_host is None else self.ucx_bind_host

    def validate(self) -> None:
        self.engine.validate()
        self.offload()
        for name in ("port", "ucx_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"prefill {name} must be in [0, 65535], got {getattr(self, name)}")
        if self.encoder_landing_bytes < 1 << 20:
            raise ValueError(
                f"--encoder-landing-mb must be >= 1, got {self.encoder_landing_bytes >> 20}"
            )
        try:
            resolve_bind_address(self.kv_bind_host)
        except ValueError as e:
            raise ValueError(f"--ucx-bind / --ucx-host: {e}") from None
        if self.metrics_port < -1 or self.metrics_port > 65535:
            raise ValueError(
                f"metrics port must be -1 (off) or in [0, 65535], got {self.metrics_port}"
            )
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
        for tls in (self.tls, self.encoder_tls):
            if tls is not None:
                tls.validate()
        if not 0 <= self.drain_grace <= 3600:
            raise ValueError(f"--drain-grace must be in [0, 3600] seconds, got {self.drain_grace}")
        if self.default_timeout <= 0:
            raise ValueError(f"default_timeout must be positive, got {self.default_timeout}")
