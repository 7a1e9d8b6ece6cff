"""The Qwen3 family: `Qwen3ForCausalLM` (GGUF `qwen3`).

As transformers' modeling_qwen3: a Llama layer plus an RMSNorm over each q and k head before
rope, `head_dim` free of hidden / heads, `attention_bias` (off in released models) on q/k/v and
o alike, no qkv bias otherwise, tied or untied embeddings, windows as Qwen2's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.model.config import ModelConfig
from shared.model.family import Family
from shared.model.hf_config import activation, common_fields, common_to_hf, full_rotary_rope
from shared.model.llama import qwen_windows, qwen_windows_to_hf

QWEN3 = "Qwen3ForCausalLM"


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    fields = common_fields(d, {"head_dim": 128, "max_position_embeddings": 32768})
    rope_theta, rope_scaling = full_rotary_rope(d)
    window, window_layers = qwen_windows(d, fields["num_layers"])
    bias = bool(d.get("attention_bias", False))
    return ModelConfig(
        **fields,
        hidden_act=activation(d),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=bias,
        attention_out_bias=bias,
        qk_norm=True,
        sliding_window=window,
        sliding_window_layers=window_layers,
    )


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    if c.attention_bias != c.attention_out_bias:
        raise ValueError("Qwen3's attention_bias covers q/k/v and o_proj alike; cannot export")
    return (
        common_to_hf(c, "qwen3")
        | {"hidden_act": c.hidden_act, "attention_bias": c.attention_bias}
        | qwen_windows_to_hf(c)
    )


FAMILY = Family(
    name="qwen3",
    hf_architectures=(QWEN3,),
    gguf_architectures={"qwen3": QWEN3},
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
)
