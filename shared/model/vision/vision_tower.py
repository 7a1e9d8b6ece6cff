"""The vision tower a config names, built on the device in the dtype the text model runs in.

Its parameter names are the checkpoint's keys below the tower's prefix (`model.visual.` as
transformers 5 names the module, `visual.` in the published checkpoints and in what
transformers 5's save_pretrained writes), so a loader copies name for name.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.vision.qwen2_5_vl_vision import Qwen2_5VisionTower
from shared.model.vision.qwen2_vl_vision import Qwen2VisionTower
from shared.model.vision.vision_config import QWEN2_VL, VisionConfig


def build_vision_tower(config: VisionConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Parameters uninitialised: the loader fills every one."""
    if config.kind == QWEN2_VL:
        return Qwen2VisionTower(config, device, dtype)
    return Qwen2_5VisionTower(config, device, dtype)
