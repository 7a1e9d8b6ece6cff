"""The DeepSeek family: `DeepseekV2ForCausalLM` (DeepSeek-V2, V2-Lite) and
`DeepseekV3ForCausalLM` (DeepSeek-V3, R1).

As transformers' modeling_deepseek_v2 / modeling_deepseek_v3: Llama-order RMSNorm layers around
multi-head latent attention (shared/model/mla.py: q through a LoRA when `q_lora_rank` is set,
keys and values from one normed latent, a rope key shared by the heads, rotated in interleaved
pairs; yarn rope with `mscale_all_dim` also scaling the softmax), and mixture-of-experts MLPs
with shared experts after the first `first_k_dense_replace` dense layers. V3 routes by sigmoid
scores with `e_score_correction_bias` and grouped top-k, V2 by fp32 softmax, greedy or
group-limited (shared/model/router.py). The pool keeps one latent per token
(`kv_lora_rank + qk_rope_head_dim` values per layer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.model.config import ModelConfig
from shared.model.family import Family
from shared.model.hf_config import (
    activation,
    architecture_of,
    common_fields,
    common_to_hf,
    rope_from_params,
    rope_params,
    rope_scaling_to_hf,
)
from shared.model.mla_config import MlaConfig
from shared.model.moe_hf import deepseek_moe, deepseek_moe_to_hf, deepseek_v2_moe
from shared.model.rotary import yarn_mscale

DEEPSEEK_V2, DEEPSEEK_V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
MODEL_TYPES = {DEEPSEEK_V2: "deepseek_v2", DEEPSEEK_V3: "deepseek_v3"}
# transformers' defaults for the keys a config.json may leave out
_MLA_DEFAULTS = {
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    DEEPSEEK_V2: _MLA_DEFAULTS
    | {
        "max_position_embeddings": 2048,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "moe_intermediate_size": 1407,
        "first_k_dense_replace": 0,
        "topk_method": "greedy",
    },
    DEEPSEEK_V3: _MLA_DEFAULTS
    | {
        "max_position_embeddings": 4096,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "first_k_dense_replace": 3,
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    },
}


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    architecture = architecture_of(d)
    d = {**_DEFAULTS[architecture], **d}
    num_layers = int(d["num_hidden_layers"])
    # every head reads the one latent: the pool has no per-head K/V, so num_key_value_heads
    # (128 by default in transformers, whatever the head count) does not apply
    heads = int(d["num_attention_heads"])
    fields = common_fields({**d, "num_key_value_heads": heads, "head_dim": d["qk_rope_head_dim"]})
    params = rope_params(d)
    rope_theta, rope_scaling = rope_from_params(params, d)
    bias = bool(d.get("attention_bias", False))
    v3 = architecture == DEEPSEEK_V3
    return ModelConfig(
        **fields,
        hidden_act=activation(d),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=bias,
        attention_out_bias=bias,
        mlp_bias=not v3 and bool(d.get("mlp_bias", False)),
        moe=deepseek_moe(d, num_layers) if v3 else deepseek_v2_moe(d, num_layers),
        mla=_mla(d, params, pairs=not v3 or bool(d.get("rope_interleave", True))),
    )


def _mla(d: Mapping[str, Any], params: Mapping[str, Any], pairs: bool) -> MlaConfig:
    q_lora = d.get("q_lora_rank")
    nope, rope = int(d["qk_nope_head_dim"]), int(d["qk_rope_head_dim"])
    return MlaConfig(
        kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(d["v_head_dim"]),
        q_lora_rank=None if q_lora is None else int(q_lora),
        rope_pairing="interleave" if pairs else "half",
        softmax_scale=softmax_scale(nope + rope, params),
    )


def softmax_scale(qk_head_dim: int, params: Mapping[str, Any]) -> float:
    """qk_head_dim ** -0.5, times yarn's mscale(`mscale_all_dim`) squared: transformers'
    `yarn_apply_mscale` (any scaled rope type with `mscale_all_dim` set, as there)."""
    scale = qk_head_dim ** (-0.5)
    rope_type = params.get("rope_type", params.get("type", "default"))
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if rope_type != "default" and mscale_all_dim:
        mscale = yarn_mscale(params["factor"], mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    m, moe = c.mla, c.moe
    if m is None or moe is None:
        raise ValueError("a DeepSeek model has latent attention and experts")
    if c.attention_bias != c.attention_out_bias:
        raise ValueError("DeepSeek's attention_bias covers every projection; cannot export")
    rope = {"rope_type": "default"}
    if c.rope_scaling.rope_type != "default":
        rope = rope_scaling_to_hf(c.rope_scaling)
    if m.softmax_scale != softmax_scale(m.qk_head_dim, rope):
        raise ValueError("the softmax scale does not follow from the rope; cannot export")
    d = common_to_hf(c, MODEL_TYPES[c.architecture]) | deepseek_moe_to_hf(moe)
    d.update(
        hidden_act=c.hidden_act,
        attention_bias=c.attention_bias,
        num_key_value_heads=c.num_heads,
        kv_lora_rank=m.kv_lora_rank,
        q_lora_rank=m.q_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
    )
    if c.architecture == DEEPSEEK_V3:
        d["rope_interleave"] = m.rope_pairing == "interleave"
    else:
        d["mlp_bias"] = c.mlp_bias
    return d


FAMILY = Family(
    name="deepseek",
    hf_architectures=(DEEPSEEK_V2, DEEPSEEK_V3),
    # V2 or V3 by the file's expert_gating_func: see gguf_moe.py
    gguf_architectures={"deepseek2": DEEPSEEK_V3},
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
)
