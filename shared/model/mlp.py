"""The feed-forward block of a decoder layer: a gated MLP, act(gate) * up -> down, with the
gate and up projections run as one GEMM over a fused weight.

`build_mlp` is where a layer's feed-forward kind is chosen: every family served today has a dense
gated MLP in every layer (SwiGLU, or Gemma's GELU-tanh gating); a mixture-of-experts layer is a
further kind chosen here per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model import fused_ops
from shared.model.config import ModelConfig
from shared.model.gemm import PackedGemm
from shared.model.linear import Linear, register_fused_linear


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.intermediate_size = i
        self.activation = config.hidden_act
        parts = {"gate_proj": i, "up_proj": i}
        register_fused_linear(self, "gate_up", h, parts, bias, device, dtype)
        self.gate_up_gemm: PackedGemm
        self.down_proj = Linear.empty(i, h, bias, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_gemm(x)
        if self.activation == "silu" and fused_ops.usable(gate_up):
            return self.down_proj(fused_ops.silu_mul(gate_up, self.intermediate_size))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if self.activation == "gelu_pytorch_tanh":
            return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))
        return self.down_proj(F.silu(gate).mul_(up))


def build_mlp(
    config: ModelConfig, layer: int, device: torch.device, dtype: torch.dtype
) -> GatedMLP:
    """Layer `layer`'s feed-forward block (the same kind in every layer of today's families)."""
    del layer  # a per-layer choice (dense or experts) reads it
    return GatedMLP(config, device, dtype)
