"""Giving a model its LoRA adapters: the projections that take a delta, and the bank of slots
loaded with the `--lora-modules` adapters (shared/model/lora_bank.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.model.lora_adapter import ATTENTION_MODULES, LoraAdapter, read_adapter
from shared.model.lora_bank import SITES, LoraBank
from shared.model.lora_gguf import read_gguf_adapter
from shared.model.mlp import GatedMLP
from shared.model.self_attention import Attention


def lora_shapes(model: torch.nn.Module) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, module) -> (out, in) of every projection of `model` that takes a LoRA delta."""
    shapes: dict[tuple[int, str], tuple[int, int]] = {}
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.self_attn, Attention):
            for name in ATTENTION_MODULES:
                shapes[(i, name)] = tuple(getattr(layer.self_attn, name).weight.shape)
        if isinstance(layer.mlp, GatedMLP):
            for name in SITES["gate_up"] + SITES["down"]:
                shapes[(i, name)] = tuple(getattr(layer.mlp, name).weight.shape)
    return shapes


def install_lora(
    model: torch.nn.Module, modules: dict[str, str], max_loras: int, max_rank: int
) -> LoraBank:
    """Give `model` a bank of `max_loras` slots and load each `--lora-modules` NAME=PATH."""
    if len(modules) > max_loras:
        raise ValueError(f"{len(modules)} --lora-modules but --max-loras is {max_loras}")
    shapes = lora_shapes(model)
    bank = LoraBank(shapes, max_loras, max_rank, model.device, model.dtype)
    for name, path in modules.items():
        bank.load(read_lora(name, path, model, max_rank))
    model.lora = bank
    return bank


def read_lora(name: str, path: str, model: torch.nn.Module, max_rank: int) -> LoraAdapter:
    """Adapter `name` from `path`: a PEFT directory, or llama.cpp's GGUF adapter file."""
    shapes = lora_shapes(model)
    if Path(path).suffix != ".gguf":
        return read_adapter(name, path, shapes, max_rank)
    attention = model.model.layers[0].self_attn
    heads = (
        (attention.num_heads, attention.num_kv_heads)
        if isinstance(attention, Attention)
        else (1, 1)
    )
    return read_gguf_adapter(name, path, shapes, max_rank, heads)
