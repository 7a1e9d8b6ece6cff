"""The towers' 2-D rotary position embedding: a quarter of each head's rotation pairs turn with
the patch's row, a quarter with its column (Qwen2-VL's axial rope), the other half repeats them
the way `rotate_half` pairs dimension i with i + head_dim / 2.

Angles and the rotation run in fp32 and the result is cast back, as transformers does, so a
bf16 tower sees the same rotated q and k bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

Grid = tuple[int, int, int]  # (frames, patch rows, patch columns) of one image or video


def patch_positions(grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """(row, column) of every patch [num_patches, 2], in the order pixel_values lists them: the
    image processor emits a `merge x merge` block of patches at a time, blocks row-major, and
    repeats the frame's positions for each of its `t` frames."""
    positions = []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(blocks).transpose(1, 2).flatten()
        cols = cols.reshape(blocks).transpose(1, 2).flatten()
        positions.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(positions)


class VisionRope(nn.Module):
    """cos and sin [num_patches, head_dim] (fp32) of the patches' positions."""

    def __init__(self, head_dim: int, theta: float, device: torch.device) -> None:
        super().__init__()
        half = head_dim // 2
        # computed on the host as transformers does at init, then moved: the same fp32 bits
        inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.inv_freq = nn.Buffer(inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None].float() * self.inv_freq  # [n, 2, head_dim / 4]
        angles = angles.flatten(1)  # rows' angles, then columns'
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def apply_vision_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [n, heads, head_dim] by cos/sin [n, head_dim] in fp32; x's dtype back."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)
