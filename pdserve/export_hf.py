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

from shared.model.config import ModelConfig
from shared.model.gguf_tokenizer import byte_alphabet
from shared.model.llama import rope_inv_freq
from shared.model.loader import LoadedModel, load_model
from shared.model.tokenizer import ByteTokenizer, HfTokenizer

MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
)


def hf_config_dict(c: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json in the transformers 4.x spelling (5.x reads it too)."""
    d: dict[str, Any] = {
        "architectures": [c.architecture],
        "model_type": MODEL_TYPES[c.architecture],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids)
        if len(c.eos_token_ids) > 1
        else next(iter(c.eos_token_ids), None),
        "pad_token_id": c.pad_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if c.rope_scaling.rope_type == "llama3":
        s = c.rope_scaling
        d["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    if c.architecture == "LlamaForCausalLM":
        if c.attention_bias != c.attention_out_bias:
            raise ValueError("Llama's attention_bias covers q/k/v and o_proj alike; cannot export")
        d.update(attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
    d.update(_sliding_window(c))
    return d


def _sliding_window(c: ModelConfig) -> dict[str, Any]:
    if c.sliding_window is None:
        return {"sliding_window": None} if c.architecture != "LlamaForCausalLM" else {}
    if c.architecture == "MistralForCausalLM":
        return {"sliding_window": c.sliding_window}
    layers = ["full_attention"] * c.num_layers
    for i in c.sliding_window_layers:
        layers[i] = "sliding_attention"
    return {"use_sliding_window": True, "sliding_window": c.sliding_window, "layer_types": layers}


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
    expected = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).to(model.device)
    if not torch.equal(model.model.rotary_emb.inv_freq, expected):
        raise ValueError("rope frequency factors (GGUF rope_freqs) have no config.json spelling")
    out_dir.mkdir(parents=True, exist_ok=True)
    backend = _backend(loaded)
    eos = sorted(loaded.eos_token_ids)
    (out_dir / "config.json").write_text(json.dumps(hf_config_dict(c, model.dtype), indent=2))
    # named parameters are slices of fused q/k/v and gate/up buffers: save independent copies
    tensors = {n: p.detach().cpu().contiguous().clone() for n, p in model.named_parameters()}
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
