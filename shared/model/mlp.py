"""The feed-forward block of a decoder layer: a gated MLP, act(gate) * up -> down, with the
gate and up projections run as one GEMM over a fused weight.

Dense families run it in every layer (SwiGLU, or Gemma's GELU-tanh gating); a mixture-of-experts
model runs it in its dense layers and as its shared expert, and its experts gate the same way
(`build_mlp` in shared/model/moe.py chooses per layer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shared.model import fused_ops
from shared.model.config import ModelConfig
from shared.model.gemm import PackedGemm
from shared.model.linear import Linear, register_fused_linear

if TYPE_CHECKING:
    from shared.model.lora_bank import LoraStep


def gated_activation(
    gate_up: torch.Tensor, intermediate_size: int, activation: str
) -> torch.Tensor:
    """act(gate) * up of gate_up [T, 2 * intermediate_size] (gate rows first)."""
    if activation == "silu" and fused_ops.usable(gate_up):
        return fused_ops.silu_mul(gate_up, intermediate_size)
    gate, up = gate_up.split(intermediate_size, dim=-1)
    if activation == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh").mul_(up)
    return F.silu(gate).mul_(up)


class GatedMLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        intermediate_size: int | None = None,
    ) -> None:
        """`intermediate_size`: a width other than the model's (a shared expert's)."""
        super().__init__()
        h, bias = config.hidden_size, config.mlp_bias
        i = intermediate_size or config.intermediate_size
        self.intermediate_size = i
        self.activation = config.hidden_act
        parts = {"gate_proj": i, "up_proj": i}
        register_fused_linear(self, "gate_up", h, parts, bias, device, dtype)
        self.gate_up_gemm: PackedGemm
        self.down_proj = Linear.empty(i, h, bias, device, dtype)

    def forward(
        self, x: torch.Tensor, lora: LoraStep | None = None, layer: int = 0
    ) -> torch.Tensor:
        """`lora`: the step's adapter deltas, added to layer `layer`'s gate/up and down."""
        gate_up = self.gate_up_gemm(x)
        if lora is not None:
            gate_up = lora.add(layer, "gate_up", x, gate_up)
        gated = gated_activation(gate_up, self.intermediate_size, self.activation)
        down = self.down_proj(gated)
        return down if lora is None else lora.add(layer, "down", gated, down)
