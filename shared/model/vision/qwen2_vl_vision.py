"""Qwen2-VL's vision tower: patch embedding, LayerNorm blocks with full attention over each
frame and a plain MLP (QuickGELU in the released models), then the patch merger.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shared.model.vision.vision_attention import VisionAttention
from shared.model.vision.vision_config import QWEN2_VL, VisionConfig
from shared.model.vision.vision_layers import (
    ACTIVATIONS,
    PatchEmbed,
    PatchMerger,
    VisionBlock,
    check_inputs,
    frame_lengths,
    layer_norm,
    linear,
)
from shared.model.vision.vision_rope import VisionRope, patch_positions


class VisionMlp(nn.Module):
    """fc1, the config's activation, fc2."""

    def __init__(self, config: VisionConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = linear(config.embed_dim, config.intermediate_size, device, dtype)
        self.fc2 = linear(config.intermediate_size, config.embed_dim, device, dtype)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Qwen2VisionTower(nn.Module):
    """pixel_values [patches, patch_dim] of images packed in order -> their merged embeddings
    [patches / merge**2, out_hidden_size], in the same order."""

    def __init__(self, config: VisionConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        if config.kind != QWEN2_VL:
            raise ValueError(f"Qwen2VisionTower needs a {QWEN2_VL} config, got {config.kind}")
        self.config = config
        dim = config.embed_dim
        self.patch_embed = PatchEmbed(config, device, dtype)
        self.rotary_pos_emb = VisionRope(config.head_dim, config.rope_theta, device)
        self.blocks = nn.ModuleList(
            VisionBlock(
                layer_norm(dim, device, dtype),
                layer_norm(dim, device, dtype),
                VisionAttention(dim, config.num_heads, device, dtype),
                VisionMlp(config, device, dtype),
            )
            for _ in range(config.depth)
        )
        self.merger = PatchMerger(config, layer_norm(dim, device, dtype), device, dtype)
        self.requires_grad_(False)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        grids = check_inputs(self.config, pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)
        positions = patch_positions(grids, self.config.spatial_merge_size).to(x.device)
        cos, sin = self.rotary_pos_emb(positions)
        lengths = frame_lengths(grids)
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)
