"""`pdserve export-hf --model SRC OUT_DIR`: write any model pdserve loads as a Hugging Face
directory, so transformers (or another engine) runs the very same weights.

Writes config.json, model.safetensors (the weights exactly as pdserve holds them, e.g. a GGUF's
dequantized tensors), tokenizer.json, tokenizer_config.json (bos/eos/pad text, chat template),
generation_config.json (every eos id, the model's sampling defaults) and chat_template.jinja.
The byte-level `tiny` tokenizer is written as the equivalent byte-level BPE tokenizer.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from shared.model.causal_lm import Model
from shared.model.config import ModelConfig
from shared.model.gguf_tokenizer import byte_alphabet
from shared.model.loader import LoadedModel, load_model
from shared.model.registry import config_to_hf, family_for
from shared.model.rotary import rope_inv_freq
from shared.model.tokenizer import ByteTokenizer, HfTokenizer

FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
)


def hf_config_dict(c: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json as the model family's transformers class reads it."""
    return config_to_hf(c) | {"torch_dtype": str(dtype).removeprefix("torch.")}


def checkpoint_tensors(model: Model) -> dict[str, torch.Tensor]:
    """The model's weights under its family's checkpoint names, each an independent copy (the
    named parameters are slices of fused q/k/v and gate/up buffers); parts a family's
    checkpoint stacks (Phi-3's qkv_proj) are stacked again."""
    params = dict(model.named_parameters())
    layout = family_for(model.config.architecture).checkpoint_layout(params)
    return {
        name: torch.cat([params[p].detach().cpu() for p in parts]).contiguous().clone()
        for name, parts in layout.items()
    }


def byte_tokenizer_json(tok: ByteTokenizer) -> Tokenizer:
    """ByteTokenizer as byte-level BPE: byte b is id b, no merges, specials from 256 up."""
    spelling = byte_alphabet()
    backend = Tokenizer(models.BPE(vocab={spelling[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    names = {tok.bos_token_id: "<s>", tok.pad_token_id: "<pad>"}
    for i, token_id in enumerate(sorted(tok.eos_token_ids)):
        names[token_id] = f"<|eos{i}|>" if i else "</s>"
    # added tokens take the next free ids, so adding them in id order keeps every id
    specials = [names.get(i, f"<|{i}|>") for i in range(256, tok.vocab_size)]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    if tok.bos_token_id is not None:
        bos = names[tok.bos_token_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B:1",
            special_tokens=[(bos, tok.bos_token_id)],
        )
    return backend


def _backend(loaded: LoadedModel) -> Tokenizer:
    tok = loaded.tokenizer
    if isinstance(tok, HfTokenizer):
        return tok.backend
    if isinstance(tok, ByteTokenizer):
        return byte_tokenizer_json(tok)
    raise ValueError(f"cannot export a {type(tok).__name__}")


def _text(backend: Tokenizer, token_id: int | None) -> str | None:
    return None if token_id is None else backend.id_to_token(token_id)


def export_loaded(loaded: LoadedModel, out_dir: Path) -> list[Path]:
    model, c = loaded.model, loaded.config
    expected = rope_inv_freq(c.rotated_dims, c.rope_theta, c.rope_scaling).to(model.device)
    if not torch.equal(model.model.rotary_emb.inv_freq, expected):
        raise ValueError("rope frequency factors (GGUF rope_freqs) have no config.json spelling")
    out_dir.mkdir(parents=True, exist_ok=True)
    backend = _backend(loaded)
    eos = sorted(loaded.eos_token_ids)
    (out_dir / "config.json").write_text(json.dumps(hf_config_dict(c, model.dtype), indent=2))
    tensors = checkpoint_tensors(model)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    backend.save(str(out_dir / "tokenizer.json"))
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _text(backend, loaded.tokenizer.bos_token_id),
        "eos_token": _text(backend, eos[0] if eos else None),
        "pad_token": _text(backend, c.pad_token_id),
        "model_max_length": c.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    generation: dict[str, Any] = {
        "bos_token_id": loaded.tokenizer.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": c.pad_token_id,
        **loaded.generation_defaults,
    }
    written = [out_dir / f for f in FILES[:-1]]
    if loaded.chat_template is not None:
        tok_config["chat_template"] = loaded.chat_template.source
        (out_dir / "chat_template.jinja").write_text(loaded.chat_template.source)
        written.append(out_dir / "chat_template.jinja")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return written


def export_hf(spec: str, out_dir: Path, dtype: torch.dtype = torch.float32) -> list[Path]:
    return export_loaded(load_model(spec, device="cpu", dtype=dtype), out_dir)


def run(a: argparse.Namespace) -> int:
    try:
        written = export_hf(a.model, Path(a.out_dir), getattr(torch, a.dtype))
    except (ValueError, OSError) as e:
        print(f"pdserve export-hf: {e}", file=sys.stderr)
        return 2
    for file in written:
        print(file)
    return 0
