"""Projections and the token embedding, with parameters named as Hugging Face names them.

Parameters are created uninitialised (`torch.empty`): the loader either copies checkpoint tensors
in or fills dummy weights, so construction costs only the allocation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.gemm import PackedGemm


def param(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """A projection whose parameters may be slices of a larger fused weight.

    No default initialisation: the loader overwrites every parameter anyway.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        # nn.Parameter aliases the given storage, so loading into a slice fills the fused tensor.
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.gemm = PackedGemm(self.weight, self.bias)

    @classmethod
    def empty(
        cls,
        in_features: int,
        out_features: int,
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> Linear:
        weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
        return cls(weight, torch.empty(out_features, device=device, dtype=dtype) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x)


def register_fused_linear(
    owner: nn.Module,
    fused_name: str,
    in_features: int,
    parts: dict[str, int],
    bias: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Give `owner` one `Linear` child per part whose weights are row slices of one fused tensor.

    The parts keep their Hugging Face names (checkpoints load name for name) while the forward
    pass runs one GEMM over buffer `{fused_name}_weight` (and `_bias`) instead of three (q/k/v) or
    two (gate/up): a decode step is dominated by per-op overhead, not FLOPs.
    """
    total = sum(parts.values())
    weight = torch.empty(total, in_features, device=device, dtype=dtype)
    fused_bias = torch.empty(total, device=device, dtype=dtype) if bias else None
    owner.register_buffer(f"{fused_name}_weight", weight, persistent=False)
    owner.register_buffer(f"{fused_name}_bias", fused_bias, persistent=False)
    setattr(owner, f"{fused_name}_gemm", PackedGemm(weight, fused_bias))
    start = 0
    for name, rows in parts.items():
        part_bias = None if fused_bias is None else fused_bias[start : start + rows]
        owner.add_module(name, Linear(weight[start : start + rows], part_bias))
        start += rows


class Embedding(nn.Module):
    """Token embedding; `scale` (Gemma: sqrt(hidden)) multiplies it, rounded to the model dtype
    first, as transformers' scaled word embedding does."""

    def __init__(
        self,
        num: int,
        dim: int,
        device: torch.device,
        dtype: torch.dtype,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.weight = param(num, dim, device=device, dtype=dtype)
        # a 0-d tensor made once: a CUDA graph replaying forward cannot copy one in per step
        factor = None if scale is None else torch.tensor(scale).to(device=device, dtype=dtype)
        self.register_buffer("scale", factor, persistent=False)
        self.scale: torch.Tensor | None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.weight)
        return x if self.scale is None else x * self.scale
