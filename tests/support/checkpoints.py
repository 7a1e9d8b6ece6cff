"""The tests' tiny checkpoints: every family pdserve loads, written by the benchmarks' writer
(pdserve/bench/support/checkpoints.py) from a transformers config built here.

`build_checkpoint("llama" | "llama3" | "qwen2" | "mistral" | a family of FAMILY_ARCHES, out_dir)`
and `cached_checkpoint(root, arch, ...)` (once per distinct argument set under `root`; a
session-scoped fixture wrapping it keeps suites fast).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdserve.bench.support import checkpoints
from pdserve.bench.support.checkpoints import (
    BOS_TOKEN,
    EOS_TOKEN,
    EOT_TOKEN,
    base_config,
    build_tokenizer,
    load_hf_model,
    special_ids,
)

__all__ = ["BOS_TOKEN", "EOS_TOKEN", "EOT_TOKEN", "build_tokenizer", "load_hf_model", "special_ids"]

ARCHES: tuple[str, ...] = ("llama", "llama3", "qwen2", "mistral")
# the other families' tiny checkpoints (tests/test_families_parity.py, test_families_moe.py)
FAMILY_ARCHES: tuple[str, ...] = (
    *("qwen3", "gemma2", "gemma3", "phi3"),
    *("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3"),
)

# The band boundaries fall inside head_dim 16's wavelength range, so all three llama3 regimes
# (kept, smoothed, divided) occur.
LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


def hf_config(arch: str, overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    base = base_config()
    if arch == "llama":
        return LlamaConfig(**{**base, **overrides})
    if arch == "llama3":
        return LlamaConfig(**{**base, "rope_parameters": dict(LLAMA3_ROPE), **overrides})
    if arch == "qwen2":
        # Tied embeddings like the small real Qwen2 models; qkv bias is built into Qwen2. With
        # tied embeddings and std-0.02 weights the residual stream is dominated by the input
        # token's own embedding, so greedy decoding repeats it forever; a larger init makes
        # decode-parity tests see varied tokens.
        qwen2 = {"tie_word_embeddings": True, "initializer_range": 0.2}
        return Qwen2Config(**{**base, **qwen2, **overrides})
    if arch == "mistral":
        return MistralConfig(**{**base, "sliding_window": None, **overrides})
    return _family_config(arch, base, overrides)


def _family_config(arch: str, base: dict[str, Any], overrides: dict[str, Any]) -> Any:
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        Gemma2Config,
        Gemma3TextConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    classes = {
        "mixtral": (MixtralConfig, "MixtralForCausalLM"),
        "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
        "qwen2_moe": (Qwen2MoeConfig, "Qwen2MoeForCausalLM"),
        "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
        "gemma2": (Gemma2Config, "Gemma2ForCausalLM"),
        "gemma3": (Gemma3TextConfig, "Gemma3ForCausalLM"),
        "phi3": (Phi3Config, "Phi3ForCausalLM"),
        "deepseek_v2": (DeepseekV2Config, "DeepseekV2ForCausalLM"),
        "deepseek_v3": (DeepseekV3Config, "DeepseekV3ForCausalLM"),
    }
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHES + FAMILY_ARCHES}")
    config_class, architecture = classes[arch]
    # a larger init than transformers' 0.02 so greedy decoding varies (see qwen2 above); no
    # pad id (Phi-3's default lies outside the small vocabulary)
    family = {"initializer_range": 0.2, "pad_token_id": None, "architectures": [architecture]}
    return config_class(**{**base, **family, **overrides})


def build_checkpoint(arch: str, out_dir: Path, **kwargs: Any) -> Path:
    return checkpoints.build_checkpoint(arch, out_dir, config_for=hf_config, **kwargs)


def cached_checkpoint(root: Path, arch: str, **kwargs: Any) -> Path:
    return checkpoints.cached_checkpoint(root, arch, config_for=hf_config, **kwargs)
