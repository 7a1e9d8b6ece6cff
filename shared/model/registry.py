"""The model families pdserve serves, looked up by a checkpoint's Hugging Face `architectures`
name or a GGUF file's `general.architecture`. Anything else fails at start-up with the list of
what is supported.

Every family builds the one model class (shared/model/causal_lm.py) from its `ModelConfig`; a
family adds its config mapping and tensor-name mapping here (shared/model/family.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from shared.model import (
    deepseek,
    gemma,
    llama,
    mixtral,
    phi3,
    qwen2_moe,
    qwen2_vl,
    qwen3,
    qwen3_moe,
)
from shared.model.causal_lm import Model
from shared.model.config import ModelConfig
from shared.model.family import Family
from shared.model.hf_config import architecture_of

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen3.FAMILY,
    gemma.FAMILY,
    phi3.FAMILY,
    mixtral.FAMILY,
    qwen3_moe.FAMILY,
    qwen2_moe.FAMILY,
    deepseek.FAMILY,
    qwen2_vl.FAMILY,
)
_BY_HF = {name: f for f in FAMILIES for name in f.hf_architectures}
GGUF_ARCHITECTURES = {g: hf for f in FAMILIES for g, hf in f.gguf_architectures.items()}


def supported_architectures() -> list[str]:
    return list(_BY_HF)


def supported_gguf_architectures() -> list[str]:
    return sorted(GGUF_ARCHITECTURES)


def family_for(architecture: str) -> Family:
    """The family serving Hugging Face architecture `architecture`."""
    family = _BY_HF.get(architecture)
    if family is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {supported_architectures()}"
        )
    return family


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    """`ModelConfig` of a parsed Hugging Face config.json (transformers 4.x or 5.x layout)."""
    try:
        architecture = architecture_of(d)
    except ValueError:
        raise ValueError(
            f"config.json has no 'architectures'; supported: {supported_architectures()}"
        ) from None
    return family_for(architecture).config_from_hf(d)


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """config.json for `c`, as its family's transformers class reads it."""
    return family_for(c.architecture).config_to_hf(c)


def build_model(
    config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Model:
    """The model for `config`, parameters uninitialised; refuses an unsupported architecture."""
    family_for(config.architecture)
    return Model(config, device, dtype)
