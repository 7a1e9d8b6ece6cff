"""One decoder layer: pre-norm attention and MLP around the residual stream, with Gemma's
"sandwich" variant (a norm on the attention output and a pre/post pair around the MLP).

Each residual add is deferred to the norm that follows it, with which it fuses: a layer takes
the previous layer's output `pending` and returns its own.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.mla import LatentAttention
from shared.model.mlp import GatedMLP
from shared.model.moe import build_mlp
from shared.model.norms import make_norm
from shared.model.self_attention import Attention
from shared.model.step_context import StepContext


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        h, eps, kind = config.hidden_size, config.rms_norm_eps, config.norm
        self.self_attn: Attention | LatentAttention = (
            Attention(config, layer, device, dtype)
            if config.mla is None
            else LatentAttention(config, layer, device, dtype)
        )
        self.mlp = build_mlp(config, layer, device, dtype)
        self.layer = layer
        self.input_layernorm = make_norm(kind, h, eps, device, dtype)
        self.post_attention_layernorm = make_norm(kind, h, eps, device, dtype)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(kind, h, eps, device, dtype)
            self.post_feedforward_layernorm = make_norm(kind, h, eps, device, dtype)

    def forward(
        self, x: torch.Tensor, pending: torch.Tensor | None, step: StepContext
    ) -> torch.Tensor:
        """Add the previous layer's output `pending` (None at the first layer) to the residual
        stream x in place, run this layer, and return its MLP output: the next layer's pending."""
        h = self.input_layernorm.add_forward(x, pending)
        attn = self.self_attn(h, step)
        if not self.sandwich:
            return self._mlp(self.post_attention_layernorm.add_forward(x, attn), step)
        h = self.pre_feedforward_layernorm.add_forward(x, self.post_attention_layernorm(attn))
        return self.post_feedforward_layernorm(self._mlp(h, step))

    def _mlp(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        if step.lora is None or not isinstance(self.mlp, GatedMLP):
            return self.mlp(h)
        return self.mlp(h, step.lora, self.layer)
