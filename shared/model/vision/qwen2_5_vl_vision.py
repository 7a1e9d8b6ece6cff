"""Qwen2.5-VL's vision tower: Qwen2-VL's, with RMSNorm, a SwiGLU MLP (with biases) and window
attention.

Most blocks attend within windows of `window_merged x window_merged` merged patches; the blocks
in `fullatt_block_indexes` attend over the whole frame. So that every window is one contiguous
segment, the patches are reordered once after the embedding, a merge block at a time (a merge
block never straddles windows): windows in row-major order per frame, merge blocks row-major
within a window. The merger then sees each merge block whole, and its output goes back to the
image processor's order by the inverse permutation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shared.cdiv import cdiv
from shared.model.norms import RMSNorm
from shared.model.vision.vision_attention import VisionAttention
from shared.model.vision.vision_config import QWEN2_5_VL, VisionConfig
from shared.model.vision.vision_layers import (
    ACTIVATIONS,
    PatchEmbed,
    PatchMerger,
    VisionBlock,
    check_inputs,
    frame_lengths,
    linear,
)
from shared.model.vision.vision_rope import Grid, VisionRope, patch_positions

NORM_EPS = 1e-6


class SwiGluMlp(nn.Module):
    """down(act(gate(x)) * up(x)), every projection biased."""

    def __init__(self, config: VisionConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        dim, hidden = config.embed_dim, config.intermediate_size
        self.gate_proj = linear(dim, hidden, device, dtype)
        self.up_proj = linear(dim, hidden, device, dtype)
        self.down_proj = linear(hidden, dim, device, dtype)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def window_order(grids: Sequence[Grid], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks' order with each window contiguous (indices into the processor's order
    of merge blocks), and the windows' lengths in patches.

    A window holds `window x window` merge blocks, fewer at a frame's right and bottom edges.
    Sorting merge blocks by (frame, window) with a stable sort keeps them row-major within each
    window, since the processor's order is row-major."""
    orders, lengths, offset = [], [], 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        windows_down, windows_across = cdiv(rows, window), cdiv(cols, window)
        per_frame = windows_down * windows_across
        window_of = (torch.arange(rows)[:, None] // window) * windows_across
        window_of = (window_of + torch.arange(cols)[None, :] // window).flatten()
        window_of = (torch.arange(t)[:, None] * per_frame + window_of).flatten()
        orders.append(torch.argsort(window_of, stable=True) + offset)
        counts = torch.bincount(window_of, minlength=t * per_frame)
        lengths.extend(n * merge * merge for n in counts.tolist())
        offset += t * rows * cols
    return torch.cat(orders), lengths


class Qwen2_5VisionTower(nn.Module):
    """pixel_values [patches, patch_dim] of images packed in order -> their merged embeddings
    [patches / merge**2, out_hidden_size], in the same order."""

    def __init__(self, config: VisionConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        if config.kind != QWEN2_5_VL:
            raise ValueError(f"Qwen2_5VisionTower needs a {QWEN2_5_VL} config, got {config.kind}")
        self.config = config
        dim = config.embed_dim
        self.patch_embed = PatchEmbed(config, device, dtype)
        self.rotary_pos_emb = VisionRope(config.head_dim, config.rope_theta, device)
        self.blocks = nn.ModuleList(
            VisionBlock(
                RMSNorm(dim, NORM_EPS, device, dtype),
                RMSNorm(dim, NORM_EPS, device, dtype),
                VisionAttention(dim, config.num_heads, device, dtype),
                SwiGluMlp(config, device, dtype),
            )
            for _ in range(config.depth)
        )
        self.merger = PatchMerger(config, RMSNorm(dim, NORM_EPS, device, dtype), device, dtype)
        self.requires_grad_(False)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        c = self.config
        grids = check_inputs(c, pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)
        order, window_lengths = window_order(grids, c.spatial_merge_size, c.window_merged)
        order = order.to(x.device)
        positions = patch_positions(grids, c.spatial_merge_size).to(x.device)
        x, cos, sin = (
            by_merge_block(y, order, c.merge_unit) for y in (x, *self.rotary_pos_emb(positions))
        )
        full_lengths = frame_lengths(grids)
        for i, block in enumerate(self.blocks):
            lengths = full_lengths if i in c.fullatt_block_indexes else window_lengths
            x = block(x, cos, sin, lengths)
        merged = self.merger(x)
        out = torch.empty_like(merged)
        out[order] = merged
        return out


def by_merge_block(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """x's rows [n, d], reordered a merge block (`unit` consecutive rows) at a time."""
    return x.view(-1, unit, x.shape[-1])[order].view(-1, x.shape[-1])
