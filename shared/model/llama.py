"""The Llama family: `LlamaForCausalLM`, `Qwen2ForCausalLM`, `MistralForCausalLM` (GGUF `llama`,
`qwen2`).

Numerics follow transformers' modeling_llama / modeling_qwen2 / modeling_mistral: RMSNorm computes
its variance in fp32 and casts back before the weight multiply, RoPE uses fp32 `inv_freq` and
`rotate_half` (llama3 frequency scaling as `_compute_llama3_parameters`), the MLP is SwiGLU.
The layers are the shared building blocks (shared/model/causal_lm.py and what it imports); this
module maps the three configs onto them and re-exports the blocks under their historical names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.model.causal_lm import Model
from shared.model.config import ModelConfig
from shared.model.family import Family
from shared.model.hf_config import (
    activation,
    common_fields,
    common_to_hf,
    full_rotary_rope,
    layer_types_of,
    layer_types_windows,
)
from shared.model.linear import Linear
from shared.model.norms import RMSNorm
from shared.model.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq, rotate_half
from shared.model.self_attention import write_kv

__all__ = [
    "FAMILY",
    "Linear",
    "Model",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "rope_inv_freq",
    "rotate_half",
    "write_kv",
]

LLAMA, QWEN2, MISTRAL = "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"
MODEL_TYPES = {LLAMA: "llama", QWEN2: "qwen2", MISTRAL: "mistral"}


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    fields = common_fields(d)
    architecture, num_layers = fields["architecture"], fields["num_layers"]
    rope_theta, rope_scaling = full_rotary_rope(d)
    window, window_layers = _sliding_window(architecture, d, num_layers)
    llama_bias = architecture == LLAMA and bool(d.get("attention_bias", False))
    return ModelConfig(
        **fields,
        hidden_act=activation(d),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=architecture == QWEN2 or llama_bias,
        attention_out_bias=llama_bias,
        mlp_bias=architecture == LLAMA and bool(d.get("mlp_bias", False)),
        sliding_window=window,
        sliding_window_layers=window_layers,
    )


def _sliding_window(
    architecture: str, d: Mapping[str, Any], num_layers: int
) -> tuple[int | None, tuple[int, ...]]:
    window = d.get("sliding_window")
    if architecture == MISTRAL:
        # MistralModel applies the window to every layer whenever it is set.
        return (int(window), tuple(range(num_layers))) if window else (None, ())
    if architecture == QWEN2:
        return qwen_windows(d, num_layers)
    return None, ()


def qwen_windows(d: Mapping[str, Any], num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """Qwen2 / Qwen3: windowed only with `use_sliding_window`, on the layers `layer_types` names
    or else from `max_window_layers` on."""
    window = d.get("sliding_window")
    if not d.get("use_sliding_window", False) or not window:
        return None, ()
    if d.get("layer_types") is not None:
        return layer_types_windows(d, num_layers, window)
    layers = tuple(range(int(d.get("max_window_layers", 28)), num_layers))
    return (int(window), layers) if layers else (None, ())


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    d = common_to_hf(c, MODEL_TYPES[c.architecture]) | {"hidden_act": c.hidden_act}
    if c.architecture == LLAMA:
        if c.attention_bias != c.attention_out_bias:
            raise ValueError("Llama's attention_bias covers q/k/v and o_proj alike; cannot export")
        d.update(attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
    return d | _window_to_hf(c)


def _window_to_hf(c: ModelConfig) -> dict[str, Any]:
    if c.sliding_window is None:
        return {"sliding_window": None} if c.architecture != LLAMA else {}
    if c.architecture == MISTRAL:
        return {"sliding_window": c.sliding_window}
    return qwen_windows_to_hf(c)


def qwen_windows_to_hf(c: ModelConfig) -> dict[str, Any]:
    if c.sliding_window is None:
        return {"use_sliding_window": False, "sliding_window": None}
    return {
        "use_sliding_window": True,
        "sliding_window": c.sliding_window,
        "layer_types": layer_types_of(c),
    }


FAMILY = Family(
    name="llama",
    hf_architectures=(LLAMA, QWEN2, MISTRAL),
    gguf_architectures={"llama": LLAMA, "qwen2": QWEN2},
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
)
