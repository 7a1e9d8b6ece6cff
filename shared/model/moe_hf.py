"""config.json's mixture-of-experts keys as `MoeConfig`, per family, and back for export.

Key spellings differ by transformers version: 5.x writes Qwen's expert count as
`num_local_experts`, the released Qwen checkpoints as `num_experts`; both are read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.model.moe_config import SIGMOID, SOFTMAX_GROUPED, MoeConfig


def _required(d: Mapping[str, Any], *keys: str) -> int:
    for key in keys:
        if d.get(key) is not None:
            return int(d[key])
    raise ValueError(f"config.json lacks required key {keys[0]!r}")


def mixtral_moe(d: Mapping[str, Any]) -> MoeConfig:
    """MixtralSparseMoeBlock: every layer, softmax top-k always renormalised, fp32 weights."""
    return MoeConfig(
        num_experts=_required(d, "num_local_experts", "num_experts"),
        top_k=int(d.get("num_experts_per_tok", 2)),
        intermediate_size=_required(d, "intermediate_size"),
        norm_topk_prob=True,
    )


def qwen_moe(d: Mapping[str, Any], num_layers: int) -> MoeConfig | None:
    """Qwen2/3-MoE: experts in the layers `decoder_sparse_step` selects and `mlp_only_layers`
    leaves; None when the config has no experts (transformers then builds dense layers)."""
    num_experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    if num_experts == 0:
        return None
    step = int(d.get("decoder_sparse_step", 1))
    only_mlp = set(d.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(num_layers) if i in only_mlp or (i + 1) % step != 0)
    shared = int(d.get("shared_expert_intermediate_size") or 0)
    return MoeConfig(
        num_experts=num_experts,
        top_k=int(d.get("num_experts_per_tok", 8)),
        intermediate_size=_required(d, "moe_intermediate_size"),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        weights_in_model_dtype=True,
        shared_intermediate_size=shared,
        shared_expert_gate=shared > 0,
        dense_layers=dense,
    )


def qwen_moe_to_hf(moe: MoeConfig) -> dict[str, Any]:
    return {
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.intermediate_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(moe.dense_layers),
    }


def deepseek_moe(d: Mapping[str, Any], num_layers: int) -> MoeConfig:
    """DeepSeek-V3: sigmoid scores with `e_score_correction_bias`, grouped top-k, shared
    experts, dense MLPs in the first `first_k_dense_replace` layers."""
    moe_width = _required(d, "moe_intermediate_size")
    first_dense = min(int(d.get("first_k_dense_replace", 0)), num_layers)
    return MoeConfig(
        num_experts=_required(d, "n_routed_experts", "num_local_experts"),
        top_k=int(d.get("num_experts_per_tok", 8)),
        intermediate_size=moe_width,
        scoring=SIGMOID,
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        n_group=int(d.get("n_group") or 1),
        topk_group=int(d.get("topk_group") or 1),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        score_correction_bias=True,
        shared_intermediate_size=moe_width * int(d.get("n_shared_experts") or 0),
        dense_layers=tuple(range(first_dense)),
    )


def deepseek_v2_moe(d: Mapping[str, Any], num_layers: int) -> MoeConfig:
    """DeepSeek-V2: an fp32 softmax router, `greedy` or `group_limited_greedy` top-k, never
    renormalised (transformers' DeepseekV2TopkRouter reads no `norm_topk_prob`), shared
    experts, dense MLPs in the first `first_k_dense_replace` layers."""
    moe_width = _required(d, "moe_intermediate_size")
    method = d.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(
            f"unsupported topk_method {method!r}; supported: ['greedy', 'group_limited_greedy']"
        )
    grouped = method == "group_limited_greedy"
    first_dense = min(int(d.get("first_k_dense_replace") or 0), num_layers)
    return MoeConfig(
        num_experts=_required(d, "n_routed_experts", "num_experts"),
        top_k=_required(d, "num_experts_per_tok"),
        intermediate_size=moe_width,
        scoring=SOFTMAX_GROUPED,
        norm_topk_prob=False,
        n_group=int(d.get("n_group") or 1) if grouped else 1,
        topk_group=int(d.get("topk_group") or 1) if grouped else 1,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        shared_intermediate_size=moe_width * int(d.get("n_shared_experts") or 0),
        dense_layers=tuple(range(first_dense)),
    )


def deepseek_moe_to_hf(moe: MoeConfig) -> dict[str, Any]:
    """The keys `deepseek_moe` / `deepseek_v2_moe` read, for export."""
    if moe.dense_layers != tuple(range(len(moe.dense_layers))):
        raise ValueError("DeepSeek's dense layers are the first ones; cannot export others")
    shared, width = moe.shared_intermediate_size, moe.intermediate_size
    if shared % width:
        raise ValueError("DeepSeek's shared experts are whole experts; cannot export this width")
    d: dict[str, Any] = {
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": width,
        "n_shared_experts": shared // width,
        "first_k_dense_replace": len(moe.dense_layers),
        "routed_scaling_factor": moe.routed_scaling_factor,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "norm_topk_prob": moe.norm_topk_prob,
    }
    if moe.scoring == SOFTMAX_GROUPED:
        d["topk_method"] = "group_limited_greedy" if moe.n_group > 1 else "greedy"
    return d
