"""The pieces both Qwen2-VL towers share: the patch embedding, a pre-norm block, the merger
that folds each `merge x merge` block of patches into one embedding for the text model, and the
checks on what the image processor hands in.

Modules are built without initialisation (the loader copies every parameter in) and keep
transformers' attribute names, so the tower's parameter names are the checkpoint's keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.linear import param
from shared.model.vision.vision_config import VisionConfig
from shared.model.vision.vision_rope import Grid


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# transformers' ACT2FN entries the towers' configs name (vision_config.ACTIVATION_NAMES)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}


def linear(
    in_features: int, out_features: int, device: torch.device, dtype: torch.dtype
) -> nn.Linear:
    """A biased projection, left uninitialised."""
    return nn.utils.skip_init(nn.Linear, in_features, out_features, device=device, dtype=dtype)


def layer_norm(dim: int, device: torch.device, dtype: torch.dtype) -> nn.LayerNorm:
    return nn.utils.skip_init(nn.LayerNorm, dim, eps=1e-6, device=device, dtype=dtype)


class PatchEmbed(nn.Module):
    """Each patch row [channels * frames * patch * patch] projected to the tower's width.

    The checkpoint's weight is a Conv3d kernel whose stride equals its size: over a patch that
    is one dot product per output, so the forward is a matmul over the kernel viewed flat (the
    flattening order is the image processor's: channel, frame, row, column). That runs 3-4x
    faster than Conv3d on CPU; it sums in another order, so fp32 agrees with transformers' to
    ~1e-6 and bf16 may differ in a last bit."""

    def __init__(self, config: VisionConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Module()  # only to hold `proj.weight`, the checkpoint's name
        self.proj.weight = param(c.embed_dim, c.in_channels, *kernel, device=device, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.flatten(1))


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x)); the towers differ in the norms and the MLP."""

    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: Sequence[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """ln_q over each patch, then a `merge x merge` block of consecutive patches concatenated
    and run through Linear-GELU-Linear to the text model's width."""

    def __init__(
        self, config: VisionConfig, ln_q: nn.Module, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.merged_dim = config.embed_dim * config.merge_unit
        self.ln_q = ln_q
        self.mlp = nn.Sequential(
            linear(self.merged_dim, self.merged_dim, device, dtype),
            nn.GELU(),
            linear(self.merged_dim, config.out_hidden_size, device, dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


def check_inputs(
    config: VisionConfig, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]]
) -> list[Grid]:
    """The grids as int triples, after checking they describe pixel_values: a wrong grid would
    otherwise surface as a shape error deep in the tower, or as silently wrong positions."""
    grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw]
    merge = config.spatial_merge_size
    for t, h, w in grids:
        if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
            raise ValueError(f"grid {(t, h, w)}: positive, h and w multiples of {merge}")
    patches = sum(t * h * w for t, h, w in grids)
    if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (patches, config.patch_dim):
        raise ValueError(
            f"pixel_values {tuple(pixel_values.shape)} != ({patches}, {config.patch_dim}) "
            f"for grids {grids}"
        )
    return grids


def frame_lengths(grids: Sequence[Grid]) -> list[int]:
    """Full attention's segments: each frame of each image or video on its own."""
    return [h * w for t, h, w in grids for _ in range(t)]
