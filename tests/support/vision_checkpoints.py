"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints written by transformers, and the inputs and
greedy reference the parity tests compare against.

The vocabulary holds the 256 bytes (so the byte tokenizer serves the checkpoint) and the
family's special tokens past them; patches are 4 x 4 pixels so an image of a few dozen patches
costs microseconds.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.engine.requests.multimodal import PromptImage
from shared.model.vision.image_processor import ImageProcessorConfig, pixel_values

VOCAB = 300
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 290, 291, 292, 293
BOS, EOS = 294, 295
PATCH, TEMPORAL, MERGE = 4, 2, 2

QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"


def _text_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        # head_dim 16: 8 frequencies in time / height / width runs
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
    }


def _vision_config(arch: str) -> dict[str, Any]:
    common = {
        "depth": 2,
        "num_heads": 2,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL,
    }
    if arch == QWEN2_VL:
        return common | {"embed_dim": 32, "hidden_size": 64}
    return common | {
        "hidden_size": 32,
        "intermediate_size": 48,
        "out_hidden_size": 64,
        "window_size": 16,  # 2 x 2 merged tokens of 4-pixel patches a window
        "fullatt_block_indexes": [1],
    }


def build_vl_checkpoint(root: Path, arch: str, seed: int = 0) -> Path:
    """A random checkpoint of `arch` under root/arch (written once per root)."""
    import transformers

    path = root / arch
    if (path / "config.json").is_file():
        return path
    config_class = {
        QWEN2_VL: transformers.Qwen2VLConfig,
        QWEN2_5_VL: transformers.Qwen2_5_VLConfig,
    }[arch]
    config = config_class(
        text_config=_text_config(),
        vision_config=_vision_config(arch),
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model_class = getattr(transformers, arch)
    model = model_class(config).eval()
    with torch.no_grad():  # norms and biases off their init values, so a missed one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = {
    "<|image_pad|>": IMAGE_TOKEN,
    "<|video_pad|>": VIDEO_TOKEN,
    "<|vision_start|>": VISION_START,
    "<|vision_end|>": VISION_END,
    "<|im_start|>": BOS,
    "<|im_end|>": EOS,
}
MIN_PIXELS, MAX_PIXELS = 8 * 8, 48 * 48  # images come out 1 to 36 merged patches


def write_chat_files(path: Path) -> None:
    """A byte-level tokenizer whose special tokens sit at the config's ids, the family's chat
    layout (an image part becomes its placeholder), and small preprocessing bounds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab |= {f"<unused{i}>": i for i in range(len(vocab), IMAGE_TOKEN)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(sorted(SPECIALS, key=SPECIALS.__getitem__))
    assert all(tokenizer.token_to_id(t) == i for t, i in SPECIALS.items())
    tokenizer.save(str(path / "tokenizer.json"))
    settings = {"chat_template": CHAT_TEMPLATE, "bos_token": None, "eos_token": "<|im_end|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    processor = {
        "patch_size": PATCH,
        "temporal_patch_size": TEMPORAL,
        "merge_size": MERGE,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor))


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
    ids = torch.tensor([prompt])
    kwargs: dict[str, Any] = {}
    if images:
        kwargs = {
            "pixel_values": tower_input(images),
            "image_grid_thw": torch.tensor([i.grid for i in images]),
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
