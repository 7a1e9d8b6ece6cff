"""Per-request sampling parameters, validated before anything is allocated."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, fields, replace

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# Below this (but above 0) logits / temperature overflows float32 and sampling draws from NaN
# probabilities (found by fuzzing: 1e-40 sampled token 258 every step instead of the argmax).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off (shared.serving.wire maps the wire's 0 to 1)
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the offending field (the gRPC layer: INVALID_ARGUMENT)."""
        for f in fields(self):
            value = getattr(self, f.name)
            # inf would pass every range check below and then sample garbage (or NaN probs)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"sampling.{f.name} must be a finite number, got {value}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature == 0.0 or self.temperature >= MIN_TEMPERATURE):
            raise ValueError(
                f"sampling.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, "
                f"got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in [0, 1] (0 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"sampling.seed must fit in uint64, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"sampling.stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} allowed"
            )
        for s in self.stop:
            if not s:
                raise ValueError("sampling.stop contains an empty string")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"sampling.stop string of {len(s)} chars exceeds {MAX_STOP_STRING_CHARS}"
                )

    def with_resolved_seed(self) -> SamplingParams:
        """Fix the seed at admission so that every node draws from the same per-request stream."""
        if self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(63))
