"""What a mixture-of-experts model adds to `ModelConfig`: its router and its experts.

Built by a family from its config.json (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3). Every field a
family changes says which.
"""

from __future__ import annotations

from dataclasses import dataclass

# DeepSeek-V2's "softmax_grouped": an fp32 router, softmax, greedy or group-limited top-k
SOFTMAX, SIGMOID, SOFTMAX_GROUPED = "softmax", "sigmoid", "softmax_grouped"
SCORINGS = (SOFTMAX, SIGMOID, SOFTMAX_GROUPED)


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    # experts each token runs (`num_experts_per_tok`)
    top_k: int
    # each routed expert's SwiGLU width (Mixtral: `intermediate_size`; Qwen, DeepSeek:
    # `moe_intermediate_size`)
    intermediate_size: int
    # softmax over the router logits (Mixtral, Qwen), DeepSeek-V3's sigmoid scores or
    # DeepSeek-V2's fp32 softmax (greedy, or group-limited by each group's best score)
    scoring: str = SOFTMAX
    # the chosen weights divided by their sum (Mixtral: always; Qwen, DeepSeek: `norm_topk_prob`)
    norm_topk_prob: bool = True
    # softmax routers: the fp32 weights cast back to the router logits' dtype (Qwen) or kept
    # fp32 (Mixtral)
    weights_in_model_dtype: bool = False
    # DeepSeek-V3: experts in `n_group` groups; a token picks among the `topk_group` groups
    # whose two best corrected scores sum highest (V2's group_limited_greedy: whose best score
    # is highest; V2's greedy: one group)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # DeepSeek-V3's `e_score_correction_bias`, added to the scores for choosing only
    score_correction_bias: bool = False
    # a dense SwiGLU every token also runs: DeepSeek's `shared_experts` (n_shared_experts *
    # moe_intermediate_size wide), Qwen2-MoE's `shared_expert` behind a sigmoid gate; 0: none
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # layers whose MLP is dense (`intermediate_size` of the model): Qwen's `mlp_only_layers` and
    # those `decoder_sparse_step` skips, DeepSeek's first `first_k_dense_replace`
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoeConfig.{name} must be a positive int, got {value!r}")
        if self.scoring not in SCORINGS:
            raise ValueError(
                f"unsupported router scoring {self.scoring!r}; supported: {list(SCORINGS)}"
            )
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(
                f"{self.num_experts} experts cannot form {self.n_group} groups of which "
                f"{self.topk_group} are chosen"
            )
        experts_in_groups = self.num_experts // self.n_group * self.topk_group
        if self.top_k > experts_in_groups:
            raise ValueError(
                f"top_k {self.top_k} exceeds the {experts_in_groups} experts a token can reach"
            )
        if self.scoring == SIGMOID and self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError("grouped routing scores each group by its two best experts")

    def check_layers(self, num_layers: int) -> None:
        bad = [i for i in self.dense_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"dense (non-expert) layers {bad} outside [0, {num_layers})")

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the experts (else a dense MLP)."""
        return layer not in self.dense_layers
