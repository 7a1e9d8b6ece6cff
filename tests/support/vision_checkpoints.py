"""The parity tests' view of the tiny Qwen2-VL / Qwen2.5-VL checkpoints (written by
pdserve/bench/support/vl_checkpoints.py): random images resized as the model takes them, prompts
with their placeholders, and transformers' greedy answer for them.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from pdserve.bench.support.vl_checkpoints import (
    BOS,
    EOS,
    IMAGE_TOKEN,
    MERGE,
    QWEN2_5_VL,
    QWEN2_VL,
    TEMPORAL,
    TINY,
    VISION_END,
    VISION_START,
    build_vl_checkpoint,
)
from shared.engine.requests.multimodal import PromptImage
from shared.model.vision.image_processor import ImageProcessorConfig, pixel_values

__all__ = ["BOS", "EOS", "QWEN2_5_VL", "QWEN2_VL", "VISION_END", "build_vl_checkpoint"]

PATCH = TINY.patch
MIN_PIXELS, MAX_PIXELS = TINY.min_pixels, TINY.max_pixels
PROCESSOR = ImageProcessorConfig(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE)


def random_image(grid: tuple[int, int, int], seed: int) -> PromptImage:
    """A random picture of `grid` patches (one frame), resized as the model takes it."""
    rng = np.random.default_rng(seed)
    _, h, w = grid
    rgb = rng.integers(0, 256, (h * PATCH, w * PATCH, 3), dtype=np.uint8)
    digest = hashlib.blake2b(rgb.tobytes() + repr(grid).encode(), digest_size=16).digest()
    return PromptImage(rgb, grid, digest)


def tower_input(images: list[PromptImage]) -> torch.Tensor:
    """What transformers' processor would hand the model for these pictures."""
    pixels = [pixel_values(image.rgb, PROCESSOR).pixel_values for image in images]
    return torch.from_numpy(np.concatenate(pixels))


def image_prompt(text_parts: list[list[int]], images: list[PromptImage]) -> list[int]:
    """text_parts[0], image 1's placeholders, text_parts[1], ...: len(text_parts) must be one
    more than the images."""
    assert len(text_parts) == len(images) + 1
    ids = list(text_parts[0])
    for image, text in zip(images, text_parts[1:], strict=True):
        t, h, w = image.grid
        ids += [VISION_START] + [IMAGE_TOKEN] * (t * h * w // MERGE**2) + [VISION_END]
        ids += text
    return ids


def hf_vl_greedy(
    model: torch.nn.Module, prompt: list[int], images: list[PromptImage], max_new_tokens: int
) -> list[int]:
    """transformers' greedy continuation of `prompt` with `images`."""
    if not images:
        return hf_vl_generate(model, prompt, None, None, max_new_tokens)
    grids = torch.tensor([i.grid for i in images])
    return hf_vl_generate(model, prompt, tower_input(images), grids, max_new_tokens)


def hf_vl_generate(
    model: torch.nn.Module,
    prompt: list[int],
    pixel_values: torch.Tensor | None,
    grids: torch.Tensor | None,
    max_new_tokens: int,
) -> list[int]:
    """transformers' greedy continuation of `prompt` with the processor's output for its
    images (None, None: a text prompt)."""
    ids = torch.tensor([prompt])
    kwargs: dict[str, Any] = {}
    if pixel_values is not None:
        kwargs = {
            "pixel_values": pixel_values,
            "image_grid_thw": grids,
            "mm_token_type_ids": (ids == IMAGE_TOKEN).int(),
        }
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()
