"""A vision tower on its own, as an encoder node runs it: read from a checkpoint directory (the
tower's `visual.` weights only, never the text model's), and each image's embeddings out, as the
engine's model computes them (the same tower, dtype and preprocessing, so the same bits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.model import hf_checkpoint
from shared.model.mrope import Grid, image_token_count
from shared.model.registry import config_from_hf
from shared.model.vision.image_processor import ImageProcessorConfig, pixel_values
from shared.model.vision.vision_config import VisionConfig
from shared.model.vision.vision_tower import build_vision_tower

VISUAL_PREFIX = "visual."


def checkpoint_processor(path: Path, vision: VisionConfig) -> ImageProcessorConfig:
    """How a checkpoint's images are resized and cut (preprocessor_config.json; without it, as
    the tower takes them and otherwise as transformers does); ValueError when the file cuts
    them otherwise than the tower takes them."""
    tower = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
    settings = dict(zip(("patch_size", "temporal_patch_size", "merge_size"), tower, strict=True))
    settings |= hf_checkpoint.read_json(path / "preprocessor_config.json", required=False)
    processor = ImageProcessorConfig.from_preprocessor_config(settings)
    mine = (processor.patch_size, processor.temporal_patch_size, processor.merge_size)
    if mine != tower:
        raise ValueError(
            f"{path}/preprocessor_config.json cuts images into (patch, temporal, merge) {mine} "
            f"but the vision tower takes {tower}"
        )
    return processor


@dataclass
class ImageEncoder:
    tower: torch.nn.Module
    vision: VisionConfig
    processor: ImageProcessorConfig
    dtype: torch.dtype

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype) -> ImageEncoder:
        """ValueError when the checkpoint is not a vision model's."""
        config = config_from_hf(hf_checkpoint.read_json(path / "config.json", required=True))
        vision = config.vision
        if vision is None:
            raise ValueError(f"{path} is a text model ({config.architecture}): nothing to encode")
        tower = build_vision_tower(vision, torch.device("cpu"), dtype)
        hf_checkpoint.load_module_weights(tower, path, VISUAL_PREFIX)
        tower.eval()
        return cls(tower, vision, checkpoint_processor(path, vision), dtype)

    def encode(self, images: Sequence[tuple[np.ndarray, Grid]]) -> list[np.ndarray]:
        """[tokens, hidden] float32 embeddings of each resized RGB image (exact for a bf16
        tower: its values are bf16's), from one tower call over all of them."""
        cpu = torch.device("cpu")
        embeddings = run_tower(self.tower, self.processor, images, cpu, self.dtype)
        return [e.float().numpy() for e in embeddings]


def run_tower(
    tower: torch.nn.Module,
    processor: ImageProcessorConfig,
    images: Sequence[tuple[np.ndarray, Grid]],
    device: torch.device,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Each resized RGB image's [tokens, hidden] embeddings in `dtype`, from one call of
    `tower` over all of them: what an encoder node and a prefill engine both compute."""
    patches = [pixel_values(rgb, processor).pixel_values for rgb, _ in images]
    grids = [grid for _, grid in images]
    with torch.inference_mode():
        merged = tower(torch.from_numpy(np.concatenate(patches)).to(device, dtype), grids)
    sizes = [image_token_count(grid, processor.merge_size) for grid in grids]
    return list(merged.split(sizes))
