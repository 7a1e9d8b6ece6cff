"""What multi-head latent attention (DeepSeek-V2/V3) adds to `ModelConfig`.

Keys and values of every head are up-projections of one per-token latent (`kv_lora_rank`, after
`kv_a_layernorm`); the rope part of the key (`qk_rope_head_dim`) is shared by all heads. The
paged pool stores those two, `kv_lora_rank + qk_rope_head_dim` values per token per layer
(shared/kv/layout.py's latent layout), instead of per-head K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

# How the rope dims pair up: "interleave" rotates pairs (x0, x1), (x2, x3), ... (DeepSeek-V2's
# complex rotation, V3's `rope_interleave`); "half" rotates x_i with x_{i + d/2} (V3 without it).
ROPE_PAIRINGS: tuple[str, ...] = ("interleave", "half")


@dataclass(frozen=True)
class MlaConfig:
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # None: q comes from one projection (`q_proj`, V2-Lite); else q_a_proj, q_a_layernorm, q_b_proj
    q_lora_rank: int | None = None
    rope_pairing: str = "interleave"
    # the softmax scale: qk_head_dim ** -0.5, times yarn's mscale(mscale_all_dim) squared
    softmax_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MlaConfig.{name} must be a positive int, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be positive or None, got {self.q_lora_rank}")
        if self.rope_pairing not in ROPE_PAIRINGS:
            raise ValueError(f"unsupported rope pairing {self.rope_pairing!r}: {ROPE_PAIRINGS}")
        if self.softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be positive, got {self.softmax_scale}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the pool stores per token per layer: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim
