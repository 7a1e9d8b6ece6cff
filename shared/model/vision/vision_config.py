"""The shape of a Qwen2-VL / Qwen2.5-VL vision tower, read from a config.json's `vision_config`.

The two families spell the widths differently. Qwen2-VL: `embed_dim` is the tower's width,
`hidden_size` the text model's (what the merger projects to) and `mlp_ratio` sizes the MLP.
Qwen2.5-VL: `hidden_size` is the tower's width, `out_hidden_size` the text model's and
`intermediate_size` the MLP's. Keys a config leaves out take transformers' defaults, as
transformers itself fills them in (the published Qwen2-VL configs omit `hidden_act`, for one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

QWEN2_VL = "qwen2_vl"
QWEN2_5_VL = "qwen2_5_vl"
KINDS: tuple[str, ...] = (QWEN2_VL, QWEN2_5_VL)
# what vision_layers.ACTIVATIONS implements, by transformers' ACT2FN names
ACTIVATION_NAMES: tuple[str, ...] = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "silu")
DEFAULT_ROPE_THETA = 10000.0

# transformers 5.25's Qwen2VLVisionConfig / Qwen2_5_VLVisionConfig defaults
_DEFAULTS: dict[str, dict[str, Any]] = {
    QWEN2_VL: {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4},
    QWEN2_5_VL: {
        "depth": 32,
        "hidden_size": 3584,
        "intermediate_size": 3420,
        "out_hidden_size": 3584,
        "window_size": 112,
        "fullatt_block_indexes": (7, 15, 23, 31),
    },
}
_COMMON_DEFAULTS: dict[str, Any] = {
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
}
_DEFAULT_ACT = {QWEN2_VL: "quick_gelu", QWEN2_5_VL: "silu"}


@dataclass(frozen=True)
class VisionConfig:
    kind: str  # QWEN2_VL or QWEN2_5_VL
    depth: int
    embed_dim: int  # the tower's width
    num_heads: int
    intermediate_size: int  # the block MLP's hidden width
    out_hidden_size: int  # the text model's hidden size: what the merger projects to
    hidden_act: str
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    rope_theta: float = DEFAULT_ROPE_THETA
    # Qwen2.5-VL only: a window's side in pixels, and the blocks that attend over whole frames
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown vision tower kind {self.kind!r}: one of {KINDS}")
        for name in (
            "depth",
            "embed_dim",
            "num_heads",
            "intermediate_size",
            "out_hidden_size",
            "patch_size",
            "temporal_patch_size",
            "in_channels",
            "spatial_merge_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"VisionConfig.{name} must be a positive int, got {value!r}")
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}"
            )
        if self.head_dim % 4:
            raise ValueError(
                f"head_dim {self.head_dim} must be divisible by 4: the 2-D rope gives a quarter of "
                "each head's rotation pairs to rows and a quarter to columns"
            )
        if self.hidden_act not in ACTIVATION_NAMES:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}: {ACTIVATION_NAMES}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        self._check_windows()

    def _check_windows(self) -> None:
        if self.kind == QWEN2_VL:
            if self.window_size or self.fullatt_block_indexes:
                raise ValueError("qwen2_vl has no window attention: window_size must be 0")
            return
        if self.window_merged < 1:
            raise ValueError(
                f"window_size {self.window_size} is under one merged patch "
                f"(patch_size * spatial_merge_size = {self.patch_size * self.spatial_merge_size})"
            )
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"fullatt_block_indexes {bad} are outside the {self.depth} blocks")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch row of pixel_values: channels x frames x pixels of one patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output embedding."""
        return self.spatial_merge_size**2

    @property
    def window_merged(self) -> int:
        """A window's side in merged patches (transformers floors the division the same way)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, Any], kind: str) -> VisionConfig:
        """From a config.json's `vision_config` as transformers 5 writes it or as the published
        Qwen2-VL / Qwen2.5-VL checkpoints spell it (`in_chans`, no `rope_parameters`)."""
        if kind not in KINDS:
            raise ValueError(f"unknown vision tower kind {kind!r}: one of {KINDS}")
        d = {**_COMMON_DEFAULTS, **_DEFAULTS[kind], **vision_config}
        if "in_channels" not in vision_config and "in_chans" in vision_config:
            d["in_channels"] = vision_config["in_chans"]
        common = {
            "kind": kind,
            "depth": int(d["depth"]),
            "num_heads": int(d["num_heads"]),
            "hidden_act": str(d.get("hidden_act") or _DEFAULT_ACT[kind]),
            "patch_size": int(d["patch_size"]),
            "temporal_patch_size": int(d["temporal_patch_size"]),
            "in_channels": int(d["in_channels"]),
            "spatial_merge_size": int(d["spatial_merge_size"]),
            "rope_theta": _rope_theta(d),
        }
        if kind == QWEN2_VL:
            embed_dim = int(d["embed_dim"])
            return cls(
                embed_dim=embed_dim,
                intermediate_size=int(embed_dim * d["mlp_ratio"]),
                out_hidden_size=int(d["hidden_size"]),
                **common,
            )
        return cls(
            embed_dim=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            out_hidden_size=int(d["out_hidden_size"]),
            window_size=int(d["window_size"]),
            fullatt_block_indexes=tuple(int(i) for i in d["fullatt_block_indexes"]),
            **common,
        )


def _rope_theta(d: Mapping[str, Any]) -> float:
    """transformers 5's `rope_parameters` (axial is the only rope these towers have), or 4.x's
    flat `rope_theta`, or the default the published configs rely on."""
    rope = d.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "axial"))
    if rope_type != "axial":
        raise ValueError(f"the vision rope is axial, config asks for {rope_type!r}")
    return float(rope.get("rope_theta", d.get("rope_theta", DEFAULT_ROPE_THETA)))
