"""The Qwen2-MoE family: `Qwen2MoeForCausalLM` (Qwen1.5-MoE, Qwen2-57B-A14B).

As transformers' modeling_qwen2_moe: a Qwen2 layer (q/k/v bias with `qkv_bias`, none on o_proj)
whose MLP is `num_experts` SwiGLU experts of `moe_intermediate_size` chosen as Qwen3-MoE chooses
them (shared/model/router.py), plus a shared expert of `shared_expert_intermediate_size` that
every token runs, scaled by sigmoid(`shared_expert_gate`); dense MLPs where `mlp_only_layers` /
`decoder_sparse_step` say. Windows follow `layer_types` (5.x) or the default pattern: with
`use_sliding_window`, the even-indexed layers below `max_window_layers`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.model.config import ModelConfig
from shared.model.family import Family
from shared.model.hf_config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    activation,
    common_fields,
    common_to_hf,
    full_rotary_rope,
    layer_types_of,
    layer_types_windows,
)
from shared.model.moe_hf import qwen_moe, qwen_moe_to_hf

QWEN2_MOE = "Qwen2MoeForCausalLM"


def _layer_types(d: Mapping[str, Any], num_layers: int) -> list[str]:
    if d.get("layer_types") is not None:
        return list(d["layer_types"])
    limit = int(d.get("max_window_layers", 28))
    return [
        SLIDING_ATTENTION if (i + 1) % 2 and i < limit else FULL_ATTENTION
        for i in range(num_layers)
    ]


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    fields = common_fields(d)
    num_layers = fields["num_layers"]
    rope_theta, rope_scaling = full_rotary_rope(d)
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    d = {**d, "layer_types": _layer_types(d, num_layers)}
    window, window_layers = layer_types_windows(d, num_layers, window)
    return ModelConfig(
        **fields,
        hidden_act=activation(d),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=bool(d.get("qkv_bias", True)),
        sliding_window=window,
        sliding_window_layers=window_layers,
        moe=qwen_moe(d, num_layers),
    )


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    if c.attention_out_bias:
        raise ValueError("Qwen2-MoE has no o_proj bias; cannot export")
    moe = c.moe
    experts: dict[str, Any] = {"num_experts": 0}
    if moe is not None:
        experts = qwen_moe_to_hf(moe) | {
            "shared_expert_intermediate_size": moe.shared_intermediate_size
        }
    return (
        common_to_hf(c, "qwen2_moe")
        | {"hidden_act": c.hidden_act, "qkv_bias": c.attention_bias}
        | {"use_sliding_window": c.sliding_window is not None}
        | {"sliding_window": c.sliding_window, "layer_types": layer_types_of(c)}
        | experts
    )


FAMILY = Family(
    name="qwen2_moe",
    hf_architectures=(QWEN2_MOE,),
    gguf_architectures={},  # GGUF qwen2moe: not yet
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
)
