"""The benchmark's models: SmolLM2-135M-shaped and a 1.1B Llama-shaped config, written as real
checkpoints (config.json, dummy bf16 safetensors drawn on the GPU, tokenizer.json) so separate
node processes load them like any model directory; and the run's time budget."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    # SmolLM2-135M(-Instruct)'s config.json shapes; weights are dummy (the GGUF is not carried)
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # Llama-3.2-1B's shapes with a 32k vocabulary: 32 KiB of bf16 KV per token
    "llama-1.1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


# where and in which dtype the benchmark runs; `use_smoke` switches to CPU
DEVICE = {"name": "cuda", "dtype": "bfloat16"}
SMOKE_SHAPES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)


def use_smoke() -> None:
    """Shrink every model and run on CPU in fp32: the whole benchmark's plumbing in a minute
    (`gpu_bench.py --smoke`), so the GPU's scarce minutes are not spent on a typo."""
    DEVICE.update(name="cpu", dtype="float32")
    for shapes in MODELS.values():
        shapes.update(SMOKE_SHAPES)


def prompt_ids(rng: Any, n: int, name: str) -> list[int]:
    """`n` random token ids of model `name`, clear of the byte tokenizer's specials."""
    return [rng.randrange(300, min(30000, MODELS[name]["vocab_size"])) for _ in range(n)]


def config_json(name: str) -> dict[str, Any]:
    c = MODELS[name]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "bos_token_id": 256,
        "eos_token_id": 257,
        "torch_dtype": "bfloat16",
        **c,
    }


def kv_bytes_per_token(name: str) -> int:
    c, itemsize = MODELS[name], 2 if DEVICE["dtype"] == "bfloat16" else 4
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * itemsize


def param_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes, from pdserve's own model on the meta device."""
    import torch

    from shared.model.registry import build_model, config_from_hf

    model = build_model(config_from_hf(config_json(name)), "meta", torch.bfloat16)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def write_checkpoint(name: str, root: Path) -> Path:
    """config.json, dummy bf16 weights (drawn on the GPU: seconds, not minutes), tokenizer."""
    import torch
    from safetensors.torch import save_file

    from pdserve.bench.support.checkpoints import build_tokenizer

    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    device = DEVICE["name"]
    gen = torch.Generator(device).manual_seed(0)
    tensors = {}
    for n, shape in param_shapes(name).items():
        if n.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
        tensors[n] = t.cpu().contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config_json(name), indent=1))
    build_tokenizer().save(str(out / "tokenizer.json"))
    return out
