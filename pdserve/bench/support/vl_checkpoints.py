"""Random Qwen2-VL / Qwen2.5-VL checkpoints written by transformers, with what serving them
takes: a byte-level tokenizer with the family's special tokens, its chat layout (an image part
becomes its placeholder) and the processor's settings. The image benchmark serves one of a
realistic tower size; the parity tests serve tiny ones (4 x 4 pixel patches, a few dozen per
image).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VOCAB = 300
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 290, 291, 292, 293
BOS, EOS = 294, 295
TEMPORAL, MERGE = 2, 2

QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"


@dataclass(frozen=True)
class VlShape:
    """The checkpoint's sizes: the tiny default the parity tests serve."""

    hidden: int = 64  # the text model's; 4 heads of hidden / 4
    layers: int = 2
    vision_width: int = 32
    vision_depth: int = 2
    vision_heads: int = 2
    patch: int = 4
    min_pixels: int = 8 * 8
    max_pixels: int = 48 * 48  # images come out 1 to 36 merged patches


TINY = VlShape()


def _text_config(shape: VlShape) -> dict[str, Any]:
    head_dim = shape.hidden // 4
    # mRoPE: head_dim / 2 frequencies in time / height / width runs, as Qwen2-VL's 16/24/24
    time = head_dim // 8
    section = [
        time,
        (head_dim // 2 - time) // 2,
        head_dim // 2 - time - (head_dim // 2 - time) // 2,
    ]
    return {
        "vocab_size": VOCAB,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.hidden * 3 // 2,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "rope_parameters": {"rope_type": "default", "mrope_section": section, "rope_theta": 1e4},
    }


def _vision_config(arch: str, shape: VlShape) -> dict[str, Any]:
    common = {
        "depth": shape.vision_depth,
        "num_heads": shape.vision_heads,
        "patch_size": shape.patch,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL,
    }
    if arch == QWEN2_VL:
        return common | {"embed_dim": shape.vision_width, "hidden_size": shape.hidden}
    return common | {
        "hidden_size": shape.vision_width,
        "intermediate_size": shape.vision_width * 3 // 2,
        "out_hidden_size": shape.hidden,
        "window_size": shape.patch * MERGE * 2,  # 2 x 2 merged tokens a window
        "fullatt_block_indexes": [shape.vision_depth - 1],
    }


def build_vl_checkpoint(root: Path, arch: str, seed: int = 0, shape: VlShape = TINY) -> Path:
    """A random checkpoint of `arch` under root/arch (written once per root), ready to serve."""
    import transformers

    path = root / arch
    if (path / "config.json").is_file():
        return path
    config_class = {
        QWEN2_VL: transformers.Qwen2VLConfig,
        QWEN2_5_VL: transformers.Qwen2_5_VLConfig,
    }[arch]
    config = config_class(
        text_config=_text_config(shape),
        vision_config=_vision_config(arch, shape),
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
    write_chat_files(path, shape)
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


def write_chat_files(path: Path, shape: VlShape = TINY) -> None:
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
        "patch_size": shape.patch,
        "temporal_patch_size": TEMPORAL,
        "merge_size": MERGE,
        "min_pixels": shape.min_pixels,
        "max_pixels": shape.max_pixels,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
