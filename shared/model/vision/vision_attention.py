"""Self-attention of a vision block: every image (or frame, or window) attends to itself only,
with no causal mask, the segments lying packed one after another in one sequence.

Segments of equal length run as one batched SDPA call: a Qwen2.5-VL frame splits into many
windows of the same size, and one call per window would be a launch per few hundred patches.
Each batch row is the same computation as one call per segment, so the result is too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.vision.vision_layers import linear
from shared.model.vision.vision_rope import apply_vision_rope


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]
) -> torch.Tensor:
    """Block-diagonal attention of q, k, v [n, heads, head_dim] over segments of `lengths`
    (summing to n); returns [n, heads, head_dim]."""
    if len(lengths) == 1:  # as a batch of one, as transformers calls it: the same kernel
        out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)))
        return out[0].transpose(0, 1)
    starts_by_length: dict[int, list[int]] = {}
    start = 0
    for length in lengths:
        starts_by_length.setdefault(length, []).append(start)
        start += length
    out = torch.empty_like(q)
    for length, starts in starts_by_length.items():
        first = torch.tensor(starts, device=q.device)
        index = (first[:, None] + torch.arange(length, device=q.device)).flatten()
        # [segments, heads, length, head_dim] for SDPA
        batch = [x[index].unflatten(0, (len(starts), length)).transpose(1, 2) for x in (q, k, v)]
        out[index] = F.scaled_dot_product_attention(*batch).transpose(1, 2).flatten(0, 1)
    return out


class VisionAttention(nn.Module):
    """qkv (one fused projection, with bias), the 2-D rope on q and k, attention, proj."""

    def __init__(self, dim: int, num_heads: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = linear(dim, 3 * dim, device, dtype)
        self.proj = linear(dim, dim, device, dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: Sequence[int]
    ) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(1)
        q, k = apply_vision_rope(q, cos, sin), apply_vision_rope(k, cos, sin)
        return self.proj(segment_attention(q, k, v, lengths).flatten(1))
