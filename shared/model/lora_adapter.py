"""A PEFT LoRA adapter read from disk (`adapter_config.json` + `adapter_model.safetensors`) and
checked against the base model it will run on.

Numerics follow peft's `LoraLayer`: a targeted projection computes `W x + s * B (A x)` with
`s = lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`), per module overridden by
`rank_pattern` / `alpha_pattern`. The scale is folded into B here, in fp32, once.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections a pdserve decoder layer can add a LoRA delta to, by their Hugging Face names.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.default)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter that cannot run on this base model; the message names the file and field."""


@dataclass(frozen=True)
class LoraModule:
    a: torch.Tensor  # [r, in] fp32
    b: torch.Tensor  # [out, r] fp32, already multiplied by the module's scale


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: Path
    rank: int  # the largest rank of any module
    base_model: str | None  # `base_model_name_or_path`, informational
    modules: dict[tuple[int, str], LoraModule]  # (layer, module name) -> its A and B
    # a digest of its config and weights files: the KV it makes is keyed by it, so an adapter
    # reloaded under the same name with other weights never reads the old one's cached KV
    fingerprint: bytes = b""

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.modules})


def read_adapter(
    name: str, path: str | Path, shapes: Mapping[tuple[int, str], tuple[int, int]], max_rank: int
) -> LoraAdapter:
    """Read and validate adapter `name` at directory `path`. `shapes` is the base model's
    (layer, module) -> (out_features, in_features) for every projection an adapter may target."""
    root = Path(path)
    config = _read_config(root)
    weights_file = root / WEIGHTS_FILE
    if not weights_file.is_file():
        raise AdapterError(f"{weights_file}: missing (a PEFT adapter saves its weights there)")
    data = weights_file.read_bytes()
    tensors = load(data)
    pairs = _pair_tensors(weights_file, tensors, shapes)
    modules = {
        key: checked_module(weights_file, config, key, a, b, shapes[key], max_rank)
        for key, (a, b) in pairs.items()
    }
    if not modules:
        raise AdapterError(f"{weights_file}: no lora_A/lora_B weights of a supported projection")
    return LoraAdapter(
        name=name,
        path=root,
        rank=max(m.a.shape[0] for m in modules.values()),
        base_model=config.get("base_model_name_or_path"),
        modules=modules,
        fingerprint=_fingerprint((root / CONFIG_FILE).read_bytes(), data),
    )


def _fingerprint(config: bytes, weights: bytes) -> bytes:
    digest = hashlib.sha256(config)
    digest.update(b"\0")
    digest.update(weights)
    return digest.digest()[:16]


def _read_config(root: Path) -> dict[str, Any]:
    file = root / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{file}: missing (is {root} a PEFT LoRA adapter directory?)")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{file}: not valid JSON: {e}") from e
    checks = {
        "peft_type": (config.get("peft_type", "LORA") == "LORA", "only LORA adapters are served"),
        "bias": (config.get("bias", "none") == "none", "LoRA biases are not supported"),
        "use_dora": (not config.get("use_dora", False), "DoRA is not supported"),
        "fan_in_fan_out": (not config.get("fan_in_fan_out", False), "Conv1D layouts unsupported"),
        "modules_to_save": (not config.get("modules_to_save"), "full modules are not supported"),
    }
    for field, (ok, why) in checks.items():
        if not ok:
            raise AdapterError(f"{file}: field {field!r} = {config.get(field)!r}: {why}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(SUPPORTED_MODULES))
        if unknown:
            raise AdapterError(
                f"{file}: field 'target_modules' names {unknown}, which this base model has no "
                f"LoRA site for (supported: {list(SUPPORTED_MODULES)})"
            )
    for field in ("r", "lora_alpha"):
        if not isinstance(config.get(field, 8), int | float) or config.get(field, 8) <= 0:
            raise AdapterError(f"{file}: field {field!r} must be a positive number")
    return config


def _pair_tensors(
    file: Path,
    tensors: Mapping[str, torch.Tensor],
    shapes: Mapping[tuple[int, str], tuple[int, int]],
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(
                f"{file}: tensor {key!r} is not a lora_A/lora_B weight of a decoder layer's "
                f"{'/'.join(SUPPORTED_MODULES)} projection"
            )
        layer, module, which = int(m.group(1)), m.group(3), m.group(4)
        if (layer, module) not in shapes:
            raise AdapterError(
                f"{file}: tensor {key!r}: the base model has no {module} in layer {layer} that "
                "takes a LoRA delta"
            )
        found.setdefault((layer, module), {})[which] = tensor
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise AdapterError(f"{file}: layer {layer} {module}: lora_{missing} missing")
    return {key: (pair["A"], pair["B"]) for key, pair in found.items()}


def checked_module(
    file: Path,
    config: Mapping[str, Any],
    key: tuple[int, str],
    a: torch.Tensor,
    b: torch.Tensor,
    shape: tuple[int, int],
    max_rank: int,
) -> LoraModule:
    """One projection's A and B, checked against the base model's `shape` and the config's
    rank, B scaled as peft does."""
    layer, module = key
    out_features, in_features = shape
    where = f"{file}: layer {layer} {module}"
    rank = a.shape[0]
    if a.dim() != 2 or a.shape[1] != in_features:
        raise AdapterError(
            f"{where}: lora_A shape {tuple(a.shape)} does not fit the base model "
            f"(expected [r, {in_features}]): is the adapter for another base model?"
        )
    if b.dim() != 2 or tuple(b.shape) != (out_features, rank):
        raise AdapterError(
            f"{where}: lora_B shape {tuple(b.shape)} does not fit the base model "
            f"(expected [{out_features}, {rank}]): is the adapter for another base model?"
        )
    name = f"model.layers.{layer}.{'self_attn' if module in ATTENTION_MODULES else 'mlp'}.{module}"
    r = int(_pattern(config.get("rank_pattern") or {}, name, config.get("r", 8)))
    if rank != r:
        raise AdapterError(f"{where}: lora_A has rank {rank}, field 'r' / 'rank_pattern' says {r}")
    if rank > max_rank:
        raise AdapterError(f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = float(_pattern(config.get("alpha_pattern") or {}, name, config.get("lora_alpha", 8)))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
    return LoraModule(a=a.float().contiguous(), b=(b.float() * scale).contiguous())


def _pattern(patterns: Mapping[str, Any], name: str, default: Any) -> Any:
    """peft's per-module override: the first key that matches the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", name):
            return value
    return default
