"""A mixture-of-experts feed-forward block, and `build_mlp`, which picks each layer's kind.

The routed experts run batched: the step's (token, expert) pairs are sorted by expert, each
active expert runs one gate_up and one down GEMM over all its rows, and the weighted results go
back to (token, rank) order and are summed over the ranks. That is transformers' default
(`grouped_mm`) experts path, numerics included: the weight multiply promotes to the routing
weights' dtype (fp32 for Mixtral and DeepSeek), and the sum over ranks runs in rank order, so
fp32 outputs equal its up to GEMM rounding; a scatter-add (index_add_) would sum in another
order and, on CUDA, nondeterministically.

Weights are stacked per expert, gate_up [E, 2I, H] and down [E, H, I]; the per-expert
parameters carry the checkpoint names (`experts.{e}.gate_proj.weight`, ...) as views into them,
so checkpoints load name for name.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.gemm import PackedGemm
from shared.model.linear import Linear
from shared.model.mlp import GatedMLP, gated_activation
from shared.model.moe_config import MoeConfig
from shared.model.router import Router


class Expert(nn.Module):
    """One routed expert's parameters, views into its bank's stacked weights."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        gate, up = gate_up.chunk(2)
        self.gate_proj = Linear(gate, None)
        self.up_proj = Linear(up, None)
        self.down_proj = Linear(down, None)


class ExpertBank(nn.Module):
    """The routed experts: children `0` .. `E-1`, run one GEMM pair per active expert."""

    def __init__(
        self, config: ModelConfig, moe: MoeConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        e, h, i = moe.num_experts, config.hidden_size, moe.intermediate_size
        gate_up = torch.empty(e, 2 * i, h, device=device, dtype=dtype)
        down = torch.empty(e, h, i, device=device, dtype=dtype)
        self.register_buffer("gate_up_weight", gate_up, persistent=False)
        self.register_buffer("down_weight", down, persistent=False)
        for expert in range(e):
            self.add_module(str(expert), Expert(gate_up[expert], down[expert]))
        self.gate_up_gemms = [PackedGemm(gate_up[expert], None) for expert in range(e)]
        self.down_gemms = [PackedGemm(down[expert], None) for expert in range(e)]
        self.intermediate_size = i
        self.activation = config.hidden_act

    def run_expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s SwiGLU over rows [n, H] -> [n, H]."""
        gate_up = self.gate_up_gemms[expert](rows)
        return self.down_gemms[expert](
            gated_activation(gate_up, self.intermediate_size, self.activation)
        )

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """sum_r weights[t, r] * expert_{ids[t, r]}(x[t]) for tokens x [T, H]; ids, weights
        [T, k]."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "a mixture-of-experts layer sizes its GEMMs by the step's routing and cannot be "
                "captured in a CUDA graph; serve this model with --no-cuda-graphs"
            )
        tokens, k = expert_ids.shape
        flat = expert_ids.reshape(-1)  # [S = T * k] (token, rank) pairs
        order = torch.argsort(flat, stable=True)  # [S]: the pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.gate_up_gemms)).tolist()  # host sync
        rows = x.index_select(0, order // k)  # [S, H]
        out = torch.empty_like(rows)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                out[start : start + n] = self.run_expert(expert, rows[start : start + n])
                start += n
        weighted = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        # back to (token, rank) order; the ranks are summed in order, as transformers does
        pairs = torch.empty_like(weighted).index_copy_(0, order, weighted)
        return pairs.view(tokens, k, -1).sum(dim=1).to(x.dtype)


class SparseMoe(nn.Module):
    """Router (`gate`), routed experts (`experts`) and the optional shared expert: DeepSeek's
    `shared_experts`, added as is, or Qwen2-MoE's `shared_expert` behind a sigmoid
    `shared_expert_gate`."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError("a mixture-of-experts layer needs ModelConfig.moe")
        self.gate = Router(config.hidden_size, moe, device, dtype)
        self.experts = ExpertBank(config, moe, device, dtype)
        width = moe.shared_intermediate_size
        gated = bool(width) and moe.shared_expert_gate
        plain = bool(width) and not gated
        self.shared_experts = GatedMLP(config, device, dtype, width) if plain else None
        self.shared_expert = GatedMLP(config, device, dtype, width) if gated else None
        self.shared_expert_gate = (
            Linear.empty(config.hidden_size, 1, False, device, dtype) if gated else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, expert_ids = self.gate(x)
        out = self.experts(x, expert_ids, weights)
        if self.shared_experts is not None:
            return out + self.shared_experts(x)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def build_mlp(
    config: ModelConfig, layer: int, device: torch.device, dtype: torch.dtype
) -> GatedMLP | SparseMoe:
    """Layer `layer`'s feed-forward block: the experts where the config has them there, else the
    dense gated MLP."""
    if config.moe is not None and config.moe.sparse(layer):
        return SparseMoe(config, device, dtype)
    return GatedMLP(config, device, dtype)
