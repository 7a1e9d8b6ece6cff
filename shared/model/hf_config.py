"""Reading a Hugging Face `config.json` into `ModelConfig` fields: what every family shares.

Accepts both the transformers 4.x spelling (`rope_theta` + `rope_scaling`) and the 5.x spelling
(`rope_parameters`, per layer type where a family has several). Each family module maps its own
keys on top of `common_fields` (shared/model/registry.py lists the families).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.model.config import (
    DEFAULT_RMS_NORM_EPS,
    DEFAULT_ROPE_THETA,
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
    RopeScaling,
    eos_ids_from_value,
)
from shared.model.rotary import yarn_mscale

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def common_fields(d: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> dict:
    """The `ModelConfig` keyword arguments every family reads the same way. `defaults`: the
    family's transformers defaults for keys a config.json may leave out."""
    d = {**(defaults or {}), **d}
    try:
        num_heads = int(d["num_attention_heads"])
        hidden_size = int(d["hidden_size"])
        fields = {
            "architecture": architecture_of(d),
            "vocab_size": int(d["vocab_size"]),
            "hidden_size": hidden_size,
            "intermediate_size": int(d["intermediate_size"]),
            "num_layers": int(d["num_hidden_layers"]),
            "num_heads": num_heads,
        }
    except KeyError as exc:
        raise ValueError(f"config.json lacks required key {exc.args[0]!r}") from None
    return fields | {
        "num_kv_heads": int(d.get("num_key_value_heads") or num_heads),
        "head_dim": int(d.get("head_dim") or hidden_size // num_heads),
        "rms_norm_eps": float(d.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS)),
        "max_position_embeddings": int(d.get("max_position_embeddings", 4096)),
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)),
        "bos_token_id": d.get("bos_token_id"),
        "eos_token_ids": eos_ids_from_value(d.get("eos_token_id")),
        "pad_token_id": d.get("pad_token_id"),
    }


def architecture_of(d: Mapping[str, Any]) -> str:
    architectures = d.get("architectures") or []
    if not architectures:
        raise ValueError("config.json has no 'architectures'")
    return str(architectures[0])


def activation(d: Mapping[str, Any], key: str = "hidden_act", default: str = "silu") -> str:
    value = d.get(key) or default
    return str(value)


def rope_params(d: Mapping[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rope parameters of one layer type: 5.x `rope_parameters` (per layer type when keyed
    so), else 4.x `rope_scaling` with the top-level `rope_theta`."""
    params = d.get("rope_parameters")
    if params and all(isinstance(v, Mapping) for v in params.values()):
        if layer_type is None:
            raise ValueError("per-layer-type rope_parameters are not supported for this family")
        params = params.get(layer_type) or {}
    params = dict(params or d.get("rope_scaling") or {})
    params.setdefault("rope_theta", d.get("rope_theta", DEFAULT_ROPE_THETA))
    return params


def rope_from_params(params: Mapping[str, Any], d: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    """(theta, scaling) of one parameter set; `d`: the whole config (max positions fallback)."""
    theta = float(params.get("rope_theta") or DEFAULT_ROPE_THETA)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    try:
        if rope_type == "linear":
            return theta, RopeScaling(rope_type="linear", factor=float(params["factor"]))
        if rope_type == "yarn":
            return theta, yarn_from_params(params, d)
        return theta, RopeScaling(
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            # transformers falls back to max_position_embeddings when the original is missing.
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings")
                or d.get("max_position_embeddings", 0)
            ),
        )
    except KeyError as exc:
        raise ValueError(f"{rope_type} rope scaling lacks {exc.args[0]!r}") from None


def yarn_from_params(params: Mapping[str, Any], d: Mapping[str, Any]) -> RopeScaling:
    """yarn's parameters as transformers' `_compute_yarn_parameters` reads them: `factor`
    defaults to max / original positions, the cos/sin factor to the mscale ratio."""
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor else int(d.get("max_position_embeddings", 0)) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
    )


def full_rotary_rope(d: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    """(theta, scaling) of a family whose every layer rotates all of each head."""
    params = rope_params(d)
    if float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported for this family")
    return rope_from_params(params, d)


def layer_types_windows(
    d: Mapping[str, Any], num_layers: int, window: Any
) -> tuple[int | None, tuple[int, ...]]:
    """(window, sliding layers) from an explicit `layer_types` list; no window, no layers."""
    layer_types = d.get("layer_types")
    if not window or layer_types is None:
        return None, ()
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}")
    layers = tuple(i for i, t in enumerate(layer_types) if t == SLIDING_ATTENTION)
    return (int(window), layers) if layers else (None, ())


def common_to_hf(c: ModelConfig, model_type: str) -> dict[str, Any]:
    """config.json keys every family writes the same way (transformers 4.x spelling, which 5.x
    reads too); each family adds its own."""
    eos = list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else next(iter(c.eos_token_ids), None)
    d: dict[str, Any] = {
        "architectures": [c.architecture],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": c.pad_token_id,
    }
    if c.rope_scaling.rope_type != "default":
        d["rope_scaling"] = rope_scaling_to_hf(c.rope_scaling)
    return d


def rope_scaling_to_hf(s: RopeScaling) -> dict[str, Any]:
    if s.rope_type == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    if s.rope_type == "yarn":
        return {
            "rope_type": "yarn",
            "factor": s.factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
            "beta_fast": s.beta_fast,
            "beta_slow": s.beta_slow,
            "truncate": s.truncate,
            "attention_factor": s.attention_factor,
            "mscale_all_dim": s.mscale_all_dim,
        }
    return {
        "rope_type": s.rope_type,
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position_embeddings,
    }


def layer_types_of(c: ModelConfig) -> list[str]:
    return [
        SLIDING_ATTENTION if c.window_for_layer(i) is not None else FULL_ATTENTION
        for i in range(c.num_layers)
    ]
