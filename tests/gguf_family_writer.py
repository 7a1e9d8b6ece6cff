"""Write tiny Gemma 2 / Gemma 3 / Phi-3 checkpoints as GGUF the way llama.cpp's
convert_hf_to_gguf.py does: its metadata keys (windows, soft-caps, key length, rope bases and
dimension count, the layer pattern when it is not the default), tensor names from gguf's
`TensorNameMap` (Phi-3's fused `qkv_proj` / `gate_up_proj` as `attn_qkv` / `ffn_up`), every Gemma
`*norm.weight` stored plus one, Gemma 2's `lm_head` dropped (llama.cpp ties it), no Q/K row
permutation, and a SentencePiece-style (`llama`) vocabulary padded with `<unusedN>` tokens to the
model's vocabulary, as Gemma's is.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, TokenType
from safetensors.numpy import load_file

from tests.gguf_writer import (
    add_shape,
    add_spm_tokenizer,
    add_tensor,
    finish,
    spm_tokens,
    tensor_namer,
)

ARCH = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3"}
_MODEL_ARCH = {
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
}
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _add_spm_tokenizer(w: gguf.GGUFWriter, vocab_size: int, *, space_prefix: bool) -> None:
    tokens, scores, types = spm_tokens()
    for text in ("<start_of_turn>", "<end_of_turn>"):
        tokens.append(text)
        scores.append(0.0)
        types.append(int(TokenType.CONTROL))
    pad = vocab_size - len(tokens)
    tokens += [f"<unused{i}>" for i in range(pad)]
    scores += [0.0] * pad
    types += [int(TokenType.UNUSED)] * pad
    # pad 0: transformers' Phi-3 default (32000) lies outside the vocabulary
    add_spm_tokenizer(
        w, tokens, scores, types, add_bos=True, space_prefix=space_prefix, pad_token_id=0
    )
    w.add_chat_template(GEMMA_TEMPLATE)


def _common(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    add_shape(w, c)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])


def _gemma(w: gguf.GGUFWriter, arch: str, c: dict[str, Any]) -> None:
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    if c.get("final_logit_softcapping") is not None:
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
    w.add_sliding_window(c["sliding_window"])
    period = 2 if arch == "gemma2" else 6
    default = [(i + 1) % period != 0 for i in range(c["num_hidden_layers"])]
    sliding = [t == "sliding_attention" for t in c["layer_types"]]
    if sliding != default:
        w.add_sliding_window_pattern(sliding)
    if arch == "gemma3":
        params = c["rope_parameters"]
        full, local = params["full_attention"], params["sliding_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_freq_base_swa(local["rope_theta"])
        if full.get("rope_type", "default") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])


def _phi3(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    params = c.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(int(factor * c["hidden_size"]) // c["num_attention_heads"])
    w.add_rope_freq_base(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    w.add_sliding_window(c.get("sliding_window") or 0)


def write_family_gguf(
    checkpoint: Path,
    out_file: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    *,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """`extra(writer)` adds metadata or tensors of its own (the error tests' bad files)."""
    c = json.loads((checkpoint / "config.json").read_text())
    arch = ARCH[c["architectures"][0]]
    w = gguf.GGUFWriter(str(out_file), arch)
    _common(w, c)
    _phi3(w, c) if arch == "phi3" else _gemma(w, arch, c)
    _add_spm_tokenizer(w, c["vocab_size"], space_prefix=arch == "phi3")
    if extra is not None:
        extra(w)
    gguf_name = tensor_namer(_MODEL_ARCH[arch], c["num_hidden_layers"])
    for hf_name, t in sorted(load_file(str(checkpoint / "model.safetensors")).items()):
        if arch == "gemma2" and hf_name == "lm_head.weight":
            continue
        name = gguf_name(hf_name)
        if arch != "phi3" and name.endswith("norm.weight"):
            t = t.astype(np.float32) + 1.0
        add_tensor(w, name, t, qtype)
    return finish(w, out_file)
