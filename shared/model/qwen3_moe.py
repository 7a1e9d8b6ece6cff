"""The Qwen3-MoE family: `Qwen3MoeForCausalLM`.

As transformers' modeling_qwen3_moe: a Qwen3 layer (q/k norms, `head_dim` free of hidden / heads)
whose MLP is `num_experts` SwiGLU experts of `moe_intermediate_size`, `num_experts_per_tok` per
token, chosen by a softmax router renormalised only with `norm_topk_prob`, the weights cast back
to the model dtype (shared/model/router.py); dense MLPs (`intermediate_size`) in the layers
`mlp_only_layers` names or `decoder_sparse_step` skips; no shared expert. A window, when
`use_sliding_window`, applies to every layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.model.config import ModelConfig
from shared.model.family import Family
from shared.model.hf_config import activation, common_fields, common_to_hf, full_rotary_rope
from shared.model.moe_hf import qwen_moe, qwen_moe_to_hf

QWEN3_MOE = "Qwen3MoeForCausalLM"
_DEFAULTS = {"head_dim": 128, "max_position_embeddings": 32768}


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    fields = common_fields(d, _DEFAULTS)
    num_layers = fields["num_layers"]
    rope_theta, rope_scaling = full_rotary_rope(d)
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    bias = bool(d.get("attention_bias", False))
    moe = qwen_moe(d, num_layers)
    if moe is not None and moe.shared_intermediate_size:
        raise ValueError("Qwen3-MoE has no shared expert; shared_expert_intermediate_size is set")
    return ModelConfig(
        **fields,
        hidden_act=activation(d),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=bias,
        attention_out_bias=bias,
        qk_norm=True,
        sliding_window=int(window) if window else None,
        sliding_window_layers=tuple(range(num_layers)) if window else (),
        moe=moe,
    )


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    if c.attention_bias != c.attention_out_bias:
        raise ValueError("Qwen3-MoE's attention_bias covers q/k/v and o_proj alike; cannot export")
    if c.sliding_window is not None and len(c.sliding_window_layers) != c.num_layers:
        raise ValueError("Qwen3-MoE windows every layer or none; cannot export a per-layer window")
    experts = {"num_experts": 0} if c.moe is None else qwen_moe_to_hf(c.moe)
    return (
        common_to_hf(c, "qwen3_moe")
        | {"hidden_act": c.hidden_act, "attention_bias": c.attention_bias}
        | {"use_sliding_window": c.sliding_window is not None, "sliding_window": c.sliding_window}
        | experts
    )


FAMILY = Family(
    name="qwen3_moe",
    hf_architectures=(QWEN3_MOE,),
    gguf_architectures={"qwen3moe": QWEN3_MOE},  # see gguf_moe.py
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
)
