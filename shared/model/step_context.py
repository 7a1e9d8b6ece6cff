"""What every decoder layer needs for one forward pass besides its input."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.model.attention import GatherScratch
from shared.model.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from shared.model.lora_bank import LoraStep

LayerHook = Callable[[int], None]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin: [T, 1, rotated dims]


@dataclass
class StepContext:
    batch: ForwardBatch
    kv_pool: torch.Tensor
    rope: Rope  # the global rope table
    layer_hook: LayerHook | None
    scratch: GatherScratch
    local_rope: Rope | None = None  # sliding layers' own table (Gemma 3), when the model has one
    lora: LoraStep | None = None  # this step's LoRA deltas, when a request names an adapter
