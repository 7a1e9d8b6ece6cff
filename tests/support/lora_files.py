"""The reference LoRA adapters are checked against: transformers' own model with peft's LoRA
forward (`W x + lora_B(lora_A(x)) * scaling`) hooked onto its projections, in plain torch. The
adapters themselves are written in peft's layout by pdserve/bench/support/lora_adapters.py.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from pdserve.bench.support.lora_adapters import ATTENTION, AdapterSpec, write_adapter

__all__ = ["AdapterSpec", "peft_hooks", "write_adapter"]


@contextlib.contextmanager
def peft_hooks(
    hf_model: torch.nn.Module, tensors: dict[str, torch.Tensor], spec: AdapterSpec
) -> Iterator[None]:
    """transformers' model computing as peft's LoRA layer does while the block runs."""
    scaling = spec.alpha / (math.sqrt(spec.rank) if spec.rslora else spec.rank)
    handles = []
    for i, layer in enumerate(hf_model.model.layers):
        for module in spec.targets:
            part = "self_attn" if module in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{i}.{part}.{module}"
            a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]

            def hook(_m, args, output, a=a, b=b):
                return output + (args[0] @ a.T) @ b.T * scaling

            linear = getattr(getattr(layer, part), module)
            handles.append(linear.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
