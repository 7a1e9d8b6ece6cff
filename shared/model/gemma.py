"""The Gemma family, text models: `Gemma2ForCausalLM` and `Gemma3ForCausalLM` (GGUF `gemma2`,
`gemma3`).

As transformers' modeling_gemma2 / modeling_gemma3: RMSNorm with `(1 + weight)` in fp32,
embeddings times sqrt(hidden) rounded to the model dtype, a norm after attention and a pair
around the MLP, GELU-tanh gating, attention scale `query_pre_attn_scalar ** -0.5`, sliding-window
layers beside global ones (`layer_types`, or the alternating / every-sixth default pattern).
Gemma 2 soft-caps attention scores and final logits; Gemma 3 norms each q and k head, rotates
its sliding layers with their own base (`rope_local_base_freq`) and caps only the final logits
when configured (transformers passes no score cap to Gemma 3's attention).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.model.config import ModelConfig
from shared.model.family import Family
from shared.model.hf_config import (
    SLIDING_ATTENTION,
    common_fields,
    common_to_hf,
    layer_types_of,
    layer_types_windows,
    rope_from_params,
    rope_params,
)

GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
_GEMMA2_DEFAULTS = {"max_position_embeddings": 8192}
_GEMMA3_DEFAULTS = {"max_position_embeddings": 131072}
_GEMMA3_THETA = {"full_attention": 1_000_000.0, SLIDING_ATTENTION: 10_000.0}


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    gemma3 = d.get("architectures", [None])[0] == GEMMA3
    d = {**_DEFAULTS, **(_GEMMA3_DEFAULTS if gemma3 else _GEMMA2_DEFAULTS), **d}
    if d.get("use_bidirectional_attention"):
        raise ValueError("bidirectional Gemma attention (an embedding model) is not supported")
    fields = common_fields(d)
    num_layers = fields["num_layers"]
    d = {**d, "layer_types": d.get("layer_types") or _default_layer_types(d, num_layers, gemma3)}
    window, window_layers = layer_types_windows(d, num_layers, d.get("sliding_window"))
    rope = _gemma3_rope(d) if gemma3 else _gemma2_rope(d)
    return ModelConfig(
        **fields,
        **rope,
        hidden_act=str(d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"),
        norm="rms_unit_offset",
        qk_norm=gemma3,
        sandwich_norms=True,
        scale_embeddings=True,
        query_pre_attn_scalar=float(d["query_pre_attn_scalar"]),
        attn_logit_softcap=None if gemma3 else _optional(d.get("attn_logit_softcapping", 50.0)),
        final_logit_softcap=_optional(d.get("final_logit_softcapping", None if gemma3 else 30.0)),
        attention_bias=bool(d.get("attention_bias", False)),
        attention_out_bias=bool(d.get("attention_bias", False)),
        sliding_window=window,
        sliding_window_layers=window_layers,
    )


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


def _default_layer_types(d: Mapping[str, Any], num_layers: int, gemma3: bool) -> list[str]:
    """transformers' defaults: Gemma 2 alternates sliding / global, Gemma 3 has one global
    layer in every `sliding_window_pattern` (6)."""
    pattern = 2
    if gemma3:
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
    return [SLIDING_ATTENTION if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _gemma2_rope(d: Mapping[str, Any]) -> dict[str, Any]:
    theta, scaling = rope_from_params(rope_params(d), d)
    return {"rope_theta": theta, "rope_scaling": scaling}


def _gemma3_rope(d: Mapping[str, Any]) -> dict[str, Any]:
    """Global theta and scaling, and the sliding layers' theta (their rope is never scaled)."""
    params = d.get("rope_parameters")
    if params and all(isinstance(v, Mapping) for v in params.values()):
        full = {"rope_theta": _GEMMA3_THETA["full_attention"], **params.get("full_attention", {})}
        local = {
            "rope_theta": _GEMMA3_THETA[SLIDING_ATTENTION],
            **params.get(SLIDING_ATTENTION, {}),
        }
    else:
        full = {**(d.get("rope_scaling") or {})}
        full["rope_theta"] = d.get("rope_theta", _GEMMA3_THETA["full_attention"])
        local = {"rope_theta": d.get("rope_local_base_freq", _GEMMA3_THETA[SLIDING_ATTENTION])}
    theta, scaling = rope_from_params(full, d)
    local_theta, local_scaling = rope_from_params(local, d)
    if local_scaling.rope_type != "default":
        raise ValueError("scaled rope on Gemma 3's sliding layers is not supported")
    return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": local_theta}


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    gemma3 = c.architecture == GEMMA3
    d = common_to_hf(c, "gemma3_text" if gemma3 else "gemma2") | {
        "hidden_activation": c.hidden_act,
        # transformers' config class wants an int here (every released model has one)
        "query_pre_attn_scalar": _int_if_whole(c.query_pre_attn_scalar or c.head_dim),
        "final_logit_softcapping": c.final_logit_softcap,
        "attention_bias": c.attention_bias,
        "sliding_window": c.sliding_window or c.max_position_embeddings,
        "layer_types": layer_types_of(c),
    }
    if gemma3:
        d["rope_local_base_freq"] = c.local_rope_theta or c.rope_theta
    else:
        d["attn_logit_softcapping"] = c.attn_logit_softcap
    return d


def _int_if_whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


FAMILY = Family(
    name="gemma",
    hf_architectures=(GEMMA2, GEMMA3),
    gguf_architectures={"gemma2": GEMMA2, "gemma3": GEMMA3},  # see gguf_arch.py
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
)
