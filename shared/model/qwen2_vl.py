"""The Qwen2-VL family: `Qwen2VLForConditionalGeneration` and
`Qwen2_5_VLForConditionalGeneration`.

The text model is Qwen2's (bias on q/k/v, none on o_proj) with mRoPE: each head's rotary
frequencies split into time, height and width runs (`mrope_section`), turned by the prompt
positions shared/model/mrope.py assigns. The vision tower (shared/model/vision/) turns an
image's patches into embeddings that replace its placeholder tokens (`image_token_id`).

Reads both config.json layouts: transformers 5's (`text_config`, `rope_parameters` with
`mrope_section`) and the published checkpoints' (text keys at the top level, `rope_scaling:
{"type": "mrope", ...}`). The checkpoints name the text weights `model.*` and the tower's
`visual.*` in both, as the model's parameters are named.
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
    rope_from_params,
    rope_params,
)
from shared.model.llama import qwen_windows
from shared.model.vision.vision_config import VisionConfig

QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
VISION_KIND = {QWEN2_VL: "qwen2_vl", QWEN2_5_VL: "qwen2_5_vl"}


def text_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's keys of either layout, with the top level's `architectures`."""
    return {**d, **(d.get("text_config") or {}), "architectures": d.get("architectures")}


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    text = text_config(d)
    fields = common_fields(text, {"max_position_embeddings": 32768})
    params = rope_params(text)
    section = params.pop("mrope_section", None)
    if section is None:
        raise ValueError("a Qwen2-VL config.json needs rope parameters with mrope_section")
    if params.get("rope_type", params.get("type")) == "mrope":
        params["rope_type"] = "default"  # the published configs' name for plain mRoPE
    params.pop("type", None)
    rope_theta, rope_scaling = rope_from_params(params, text)
    window, window_layers = qwen_windows(text, fields["num_layers"])
    if "vision_config" not in d:
        raise ValueError("a Qwen2-VL config.json needs vision_config")
    if d.get("image_token_id") is None:
        raise ValueError("a Qwen2-VL config.json needs image_token_id")
    return ModelConfig(
        **fields,
        hidden_act=activation(text),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=True,
        sliding_window=window,
        sliding_window_layers=window_layers,
        mrope_section=tuple(int(n) for n in section),
        vision=VisionConfig.from_hf(d["vision_config"], VISION_KIND[architecture_of(d)]),
        image_token_id=int(d["image_token_id"]),
    )


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    raise ValueError(f"exporting {c.architecture} (a vision model) is not supported")


FAMILY = Family(
    name="qwen2_vl",
    hf_architectures=(QWEN2_VL, QWEN2_5_VL),
    gguf_architectures={},
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
)
