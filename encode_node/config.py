"""Encoder node configuration."""

from __future__ import annotations

from dataclasses import dataclass

from shared.model.vision.embedding_cache import DEFAULT_EMBEDDING_CACHE_BYTES
from shared.serving.limits import DRAIN_GRACE_S
from shared.serving.tls import ServerTls


@dataclass(frozen=True)
class EncodeNodeConfig:
    model: str = ""  # a vision model's Hugging Face checkpoint directory
    dtype: str = "auto"  # the prefill nodes' dtype: their towers and this one agree to the bit
    host: str = "127.0.0.1"
    port: int = 50071
    metrics_port: int = -1  # -1: no metrics endpoint, 0: an ephemeral port
    tls: ServerTls | None = None
    cache_bytes: int = DEFAULT_EMBEDDING_CACHE_BYTES  # recent images' embeddings, by content
    max_images: int = 64  # per Encode call
    max_pending: int = 32  # Encode calls queued or running before RESOURCE_EXHAUSTED
    drain_grace: float = DRAIN_GRACE_S

    def validate(self) -> None:
        if not self.model:
            raise ValueError("an encoder node needs --model: a vision model's checkpoint directory")
        if not 0 <= self.port < 65536:
            raise ValueError(f"encoder port must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(
                f"metrics port must be -1 (off) or in [0, 65535], got {self.metrics_port}"
            )
        for name in ("cache_bytes", "max_images", "max_pending"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tls is not None:
            self.tls.validate()
