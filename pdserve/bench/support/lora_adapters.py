"""Random PEFT LoRA adapters for a checkpoint, written exactly as peft's `save_pretrained` lays
them out (`adapter_config.json` + `adapter_model.safetensors`, keys
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_PROJECTIONS = (*ATTENTION, "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    targets: Sequence[str]
    seed: int
    rslora: bool = False


def write_adapter(hf_model: torch.nn.Module, out: Path, spec: AdapterSpec) -> dict[str, object]:
    """Random A and B (B non-zero, unlike peft's init, so the adapter changes the output) for
    every targeted projection of every layer of transformers' `hf_model`; returns the saved
    tensors by key."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(hf_model.model.layers):
        for module in spec.targets:
            part = "self_attn" if module in ATTENTION else "mlp"
            linear = getattr(getattr(layer, part), module)
            prefix = f"base_model.model.model.layers.{i}.{part}.{module}"
            a = torch.randn(spec.rank, linear.in_features, generator=gen) / linear.in_features**0.5
            b = 0.5 * torch.randn(linear.out_features, spec.rank, generator=gen)
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": spec.rslora,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return dict(tensors)
