"""Tiny Llama checkpoints with random weights (built offline with transformers + tokenizers): the
models of the benchmarks' quick runs, and `load_hf_model`, their transformers reference. The
tests build their other families with the same writer (tests/support/checkpoints.py).

`build_checkpoint("llama", out_dir)` writes a directory that both
`transformers.AutoModelForCausalLM.from_pretrained` and `shared.model.loader.load_model` accept:
config.json, model.safetensors (or shards + index with `max_shard_size`), generation_config.json
and a byte-level BPE tokenizer.json. The same arguments always give the same files.

`cached_checkpoint(root, arch, ...)` builds once per distinct argument set under `root`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from shared.model.gguf_tokenizer import byte_alphabet

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


def base_config() -> dict[str, Any]:
    """The small shape and this tokenizer's special ids, what every tiny config starts from."""
    ids = special_ids()
    return {**_SMALL, "bos_token_id": ids[BOS_TOKEN], "eos_token_id": ids[EOS_TOKEN]}


def llama_config(arch: str, overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    if arch != "llama":
        raise ValueError(f"unknown arch {arch!r}: the benchmarks build llama")
    return LlamaConfig(**{**base_config(), **overrides})


ConfigFor = Callable[[str, dict[str, Any]], Any]


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
    config_for: ConfigFor = llama_config,
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
    config = config_for(arch, overrides)
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


def cached_checkpoint(
    root: Path, arch: str, config_for: ConfigFor = llama_config, **kwargs: Any
) -> Path:
    """`build_checkpoint` into `root/<arch>-<hash of kwargs>`, reusing it if already built."""
    key = hashlib.sha256(repr(sorted(kwargs.items())).encode()).hexdigest()[:12]
    target = Path(root) / f"{arch}-{key}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    try:
        build_checkpoint(arch, staging, config_for=config_for, **kwargs)
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
