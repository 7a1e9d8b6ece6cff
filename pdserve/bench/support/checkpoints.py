"""Tiny Hugging Face checkpoints (built offline with transformers + tokenizers): the models of the
benchmarks' quick runs and of the parity tests, and `load_hf_model`, their transformers reference.

`build_checkpoint("llama" | "llama3" | "qwen2" | "mistral", out_dir)` writes a directory that both
`transformers.AutoModelForCausalLM.from_pretrained` and `shared.model.loader.load_model` accept:
config.json, model.safetensors (or shards + index with `max_shard_size`), generation_config.json
and a byte-level BPE tokenizer.json. The same arguments always give the same files.

`cached_checkpoint(root, arch, ...)` builds once per distinct argument set under `root`; a
session-scoped fixture wrapping it keeps suites fast.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from shared.model.gguf_tokenizer import byte_alphabet

ARCHES: tuple[str, ...] = ("llama", "llama3", "qwen2", "mistral")
# the other families' tiny checkpoints (tests/test_families_parity.py, test_families_moe.py)
FAMILY_ARCHES: tuple[str, ...] = (
    *("qwen3", "gemma2", "gemma3", "phi3"),
    *("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3"),
)

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
EOT_TOKEN = "<|eot|>"  # second stop token, only in generation_config.json

# Small enough to build in well under a second, big enough for GQA (4 heads over 2 KV heads).
_SMALL: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
}
# The band boundaries fall inside head_dim 16's wavelength range, so all three llama3 regimes
# (kept, smoothed, divided) occur.
LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
_MERGES: list[tuple[str, str]] = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("o", "n"),
]


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE: id b < 256 is byte b, a few merges above, then <s>, </s>, <|eot|>.

    Built by hand rather than trained so the ids never depend on trainer tie-breaking.
    """
    byte_chars = byte_alphabet()
    vocab = {byte_chars[b]: b for b in range(256)}
    for left, right in _MERGES:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS_TOKEN, EOS_TOKEN, EOT_TOKEN])
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tok


def special_ids() -> dict[str, int]:
    tok = build_tokenizer()
    return {name: tok.token_to_id(name) for name in (BOS_TOKEN, EOS_TOKEN, EOT_TOKEN)}


def _hf_config(arch: str, overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    ids = special_ids()
    base: dict[str, Any] = {
        **_SMALL,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
    }
    if arch == "llama":
        return LlamaConfig(**{**base, **overrides})
    if arch == "llama3":
        return LlamaConfig(**{**base, "rope_parameters": dict(LLAMA3_ROPE), **overrides})
    if arch == "qwen2":
        # Tied embeddings like the small real Qwen2 models; qkv bias is built into Qwen2. With
        # tied embeddings and std-0.02 weights the residual stream is dominated by the input
        # token's own embedding, so greedy decoding repeats it forever; a larger init makes
        # decode-parity tests see varied tokens.
        qwen2 = {"tie_word_embeddings": True, "initializer_range": 0.2}
        return Qwen2Config(**{**base, **qwen2, **overrides})
    if arch == "mistral":
        return MistralConfig(**{**base, "sliding_window": None, **overrides})
    return _family_config(arch, base, overrides)


def _family_config(arch: str, base: dict[str, Any], overrides: dict[str, Any]) -> Any:
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        Gemma2Config,
        Gemma3TextConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    classes = {
        "mixtral": (MixtralConfig, "MixtralForCausalLM"),
        "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
        "qwen2_moe": (Qwen2MoeConfig, "Qwen2MoeForCausalLM"),
        "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
        "gemma2": (Gemma2Config, "Gemma2ForCausalLM"),
        "gemma3": (Gemma3TextConfig, "Gemma3ForCausalLM"),
        "phi3": (Phi3Config, "Phi3ForCausalLM"),
        "deepseek_v2": (DeepseekV2Config, "DeepseekV2ForCausalLM"),
        "deepseek_v3": (DeepseekV3Config, "DeepseekV3ForCausalLM"),
    }
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHES + FAMILY_ARCHES}")
    config_class, architecture = classes[arch]
    # a larger init than transformers' 0.02 so greedy decoding varies (see qwen2 above); no
    # pad id (Phi-3's default lies outside the small vocabulary)
    family = {"initializer_range": 0.2, "pad_token_id": None, "architectures": [architecture]}
    return config_class(**{**base, **family, **overrides})


def _perturb_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    # transformers initialises norms to 1 and biases to 0, which would let a model that ignores
    # them pass; random values make the parity tests cover them.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        # DeepSeek-V3's router correction is a buffer, zero at init: random, it takes part
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))


def build_checkpoint(
    arch: str,
    out_dir: Path,
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    with_tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """Write a small random `arch` checkpoint to `out_dir` and return `out_dir`.

    `overrides` go to the transformers config (e.g. `num_hidden_layers=3`, `sliding_window=8`,
    `tie_word_embeddings=False`). `max_shard_size` (e.g. "40KB") saves sharded safetensors plus
    `model.safetensors.index.json`. generation_config.json lists both </s> and <|eot|> as eos,
    while config.json names only </s>.
    """
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    config = _hf_config(arch, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_norms_and_biases(model, seed)
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **save_kwargs)
    ids = special_ids()
    generation = {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[EOS_TOKEN], ids[EOT_TOKEN]],
        "do_sample": False,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if with_tokenizer:
        build_tokenizer().save(str(out_dir / "tokenizer.json"))
    return out_dir


def cached_checkpoint(root: Path, arch: str, **kwargs: Any) -> Path:
    """`build_checkpoint` into `root/<arch>-<hash of kwargs>`, reusing it if already built."""
    key = hashlib.sha256(repr(sorted(kwargs.items())).encode()).hexdigest()[:12]
    target = Path(root) / f"{arch}-{key}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    try:
        build_checkpoint(arch, staging, **kwargs)
        staging.rename(target)  # atomic: a half-written checkpoint is never visible
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def load_hf_model(path: Path) -> Any:
    """The transformers reference model for `path`: fp32, eval mode, CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()
