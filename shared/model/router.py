"""The router of a mixture-of-experts layer: which `top_k` experts each token runs, and with
what weight.

Three scorings, each as transformers computes it, dtype casts included (a router near-tie decides
differently on a one-ulp difference, so the order of operations is part of the contract):

- `softmax_topk` (MixtralTopKRouter, Qwen3MoeTopKRouter): logits in the model dtype, softmax in
  fp32, top-k in descending order, optionally renormalised to sum to one; Qwen casts the
  weights back to the logits' dtype, Mixtral keeps them fp32.
- `grouped_sigmoid_topk` (DeepseekV3TopkRouter): fp32 logits from the fp32 router weight,
  sigmoid scores; experts are chosen on the scores plus `e_score_correction_bias`, among the
  `topk_group` of `n_group` groups whose two best corrected scores sum highest; the weights are
  the uncorrected scores, optionally renormalised (+1e-20), times `routed_scaling_factor`.
- `grouped_softmax_topk` (DeepseekV2TopkRouter): fp32 logits from the fp32 router weight, fp32
  softmax; greedy top-k, or with `n_group` > 1 top-k among the `topk_group` groups holding the
  best scores (the others' scores zeroed); never renormalised, times `routed_scaling_factor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.linear import param
from shared.model.moe_config import SIGMOID, SOFTMAX, MoeConfig


def softmax_topk(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, weights_in_model_dtype: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) from router logits [T, E]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    if weights_in_model_dtype:
        weights = weights.to(logits.dtype)
    return weights, ids


def grouped_sigmoid_topk(
    logits: torch.Tensor, correction: torch.Tensor, moe: MoeConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) from fp32 router logits [T, E]."""
    scores = logits.sigmoid()
    choice = scores + correction
    tokens, experts, groups = choice.shape[0], moe.num_experts, moe.n_group
    # [T, G]: each group's two best corrected scores, summed
    group_scores = choice.view(tokens, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_ids = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups)
    choice = choice.masked_fill(~expert_mask.reshape(-1, experts).bool(), float("-inf"))
    ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * moe.routed_scaling_factor, ids


def grouped_softmax_topk(logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) from fp32 router logits [T, E]."""
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if moe.n_group > 1:
        tokens, experts, groups = scores.shape[0], moe.num_experts, moe.n_group
        group_scores = scores.view(tokens, groups, experts // groups).max(dim=-1).values
        group_ids = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups)
        scores = scores.masked_fill(~expert_mask.reshape(-1, experts).bool(), 0.0)
    weights, ids = torch.topk(scores, k=moe.top_k, dim=-1, sorted=False)
    return weights * moe.routed_scaling_factor, ids


class Router(nn.Module):
    """`gate.weight` [E, H] (and DeepSeek's `gate.e_score_correction_bias` [E])."""

    def __init__(
        self, hidden_size: int, moe: MoeConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.moe = moe
        # DeepSeek keeps its router in fp32 whatever the model dtype
        weight_dtype = dtype if moe.scoring == SOFTMAX else torch.float32
        self.weight = param(moe.num_experts, hidden_size, device=device, dtype=weight_dtype)
        self.e_score_correction_bias = (
            param(moe.num_experts, device=device, dtype=torch.float32)
            if moe.score_correction_bias
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, k], expert ids [T, k]) of tokens x [T, H]."""
        moe = self.moe
        if moe.scoring == SOFTMAX:
            logits = F.linear(x, self.weight)
            return softmax_topk(logits, moe.top_k, moe.norm_topk_prob, moe.weights_in_model_dtype)
        logits = F.linear(x.float(), self.weight.float())
        if moe.scoring != SIGMOID:
            return grouped_softmax_topk(logits, moe)
        bias = self.e_score_correction_bias
        correction = torch.zeros_like(logits[0]) if bias is None else bias
        return grouped_sigmoid_topk(logits, correction, moe)
