"""RMSNorm in the two orders the families use: Llama's (normalise in fp32, cast, then times the
weight) and Gemma's (the whole product in fp32 with `1 + weight`, then cast). In fp32 both are one
rounding apart at most; in bf16 the order decides the bits, so each copies transformers' exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model import fused_ops
from shared.model.linear import param


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(dim, device=device, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as LlamaRMSNorm so bf16 results match transformers bit for bit.
        # In-place where a fresh tensor is at hand: the same values, fewer allocations.
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(self.eps))
        return (x32 * inv_rms).to(input_dtype).mul_(self.weight)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """x += delta in place (when given), then this norm of x: one pass in bf16 on CPU."""
        if x.dim() == 2 and self.weight.dtype == x.dtype and fused_ops.usable(x):
            return fused_ops.add_rms_norm(x, delta, self.weight, self.eps)
        if delta is not None:
            x.add_(delta)
        return self(x)


class UnitOffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in fp32, cast once at the end. The
    checkpoint stores the offset weight (zeros mean identity), as transformers does."""

    def __init__(self, dim: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(dim, device=device, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        if delta is not None:
            x.add_(delta)
        return self(x)


Norm = RMSNorm | UnitOffsetRMSNorm


def make_norm(kind: str, dim: int, eps: float, device: torch.device, dtype: torch.dtype) -> Norm:
    """The norm a config's `norm` field names (ModelConfig validates the name)."""
    if kind == "rms_unit_offset":
        return UnitOffsetRMSNorm(dim, eps, device, dtype)
    return RMSNorm(dim, eps, device, dtype)
