"""Write small GGUF files from the tiny transformers checkpoints, the way llama.cpp converts.

`write_gguf(checkpoint_dir, out_file, qtype)` reads a checkpoint built by `tests.checkpoints` and
writes it with `gguf.GGUFWriter` in llama.cpp's tensor naming (`blk.N.attn_q.weight`, ...), with
llama.cpp's rope row permutation applied to llama's Q/K (convert_hf_to_gguf.py's
`LlamaModel.permute`; qwen2 is stored unpermuted), 2-D weights quantized with `gguf.quants`,
norms and biases in F32, and the byte-level BPE tokenizer as `tokenizer.ggml.*` metadata.

`write_spm_tokenizer_gguf` writes a tokenizer-only GGUF with a SentencePiece-style (`llama`)
vocabulary: byte-fallback tokens `<0xXX>`, `▁`-prefixed pieces with scores and no merges.
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

from tests.support.checkpoints import BOS_TOKEN, EOS_TOKEN, EOT_TOKEN, build_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token if loop.first else '' }}<|{{ m['role'] }}|>"
    "{{ m['content'] }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% endif %}"
)
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def gguf_name(hf_name: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)  # model.layers.N.rest
    return f"blk.{layer}.{_LAYER_NAMES[rest]}.{suffix}"


def rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation: per head, rows (x0..x_{d/2-1}, y0..) become interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def add_tensor(
    writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: GGMLQuantizationType
) -> None:
    if w.ndim == 1 or qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        return
    data = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype)
    writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)


def add_gpt2_tokenizer(writer: gguf.GGUFWriter, *, add_bos: bool, chat_template: bool) -> None:
    tok = build_tokenizer()
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    specials = {BOS_TOKEN, EOS_TOKEN, EOT_TOKEN}
    merges = json.loads(tok.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [TokenType.CONTROL if t in specials else TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(vocab[BOS_TOKEN])
    writer.add_eos_token_id(vocab[EOS_TOKEN])
    writer.add_eot_token_id(vocab[EOT_TOKEN])
    writer.add_add_bos_token(add_bos)
    if chat_template:
        writer.add_chat_template(CHAT_TEMPLATE)


def add_shape(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """The model's size from its config.json: the keys every converter writes first."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])


def tensor_namer(model_arch: gguf.MODEL_ARCH, layers: int) -> Callable[[str], str]:
    """A Hugging Face tensor name -> llama.cpp's, from gguf's `TensorNameMap` (the converter's
    own table)."""
    names = gguf.get_tensor_name_map(model_arch, layers)

    def name(hf_name: str) -> str:
        found = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert found is not None, hf_name
        return found

    return name


def finish(writer: gguf.GGUFWriter, out_file: Path) -> Path:
    """Header, metadata, then tensors: the file's layout, written in its order."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


def gpt2_vocab_size() -> int:
    return build_tokenizer().get_vocab_size(with_added_tokens=True)


def write_gguf(
    checkpoint: Path,
    out_file: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    *,
    arch_name: str | None = None,
    add_bos: bool = True,
    chat_template: bool = True,
    drop_tensors: tuple[str, ...] = (),
    sampling: dict[str, float] | None = None,
) -> Path:
    config = json.loads((checkpoint / "config.json").read_text())
    arch = (
        arch_name
        or {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[config["architectures"][0]]
    )
    writer = gguf.GGUFWriter(str(out_file), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_name(f"tiny-{arch}")
    add_shape(writer, config)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    add_gpt2_tokenizer(writer, add_bos=add_bos, chat_template=chat_template)
    for key, value in (sampling or {}).items():  # e.g. {"temp": 0.7}: general.sampling.temp
        add = writer.add_int32 if isinstance(value, int) else writer.add_float32
        add(f"general.sampling.{key}", value)
    for hf_name, w in sorted(load_file(str(checkpoint / "model.safetensors")).items()):
        name = gguf_name(hf_name)
        if name in drop_tensors:
            continue
        if arch == "llama" and ".attn_q." in name:
            w = rope_permute(w, heads)
        elif arch == "llama" and ".attn_k." in name:
            w = rope_permute(w, kv_heads)
        add_tensor(writer, name, w, qtype)
    return finish(writer, out_file)


# --------------------------------------------------------------- SentencePiece-style tokenizer

_SPM_PIECES = [
    "▁",
    "▁t",
    "he",
    "▁the",
    "▁a",
    "in",
    "▁in",
    "er",
    "on",
    "▁o",
    "▁w",
    "or",
    "ld",
    "▁wor",
    "▁world",
    "▁He",
    "ll",
    "llo",
    "▁Hello",
    "é",
    "▁é",
    "▁café",
    "caf",
    "▁caf",
    "日本",
    "日",
    "本",
    "▁▁",
    "▁▁▁",
    "▁\n",
    "\n",
    "\n\n",
    "▁is",
    "is",
    "ing",
    "▁th",
    "▁this",
]


def spm_tokens() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    chars = sorted({c for p in _SPM_PIECES for c in p} - set(_SPM_PIECES))
    pieces = [*chars, *_SPM_PIECES]
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    tokens.append("<|user|>")
    types.append(TokenType.USER_DEFINED)
    # sentencepiece scores: higher merges first; longer pieces come later (lower score)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0]
    return tokens, scores, [int(t) for t in types]


def add_spm_tokenizer(
    writer: gguf.GGUFWriter,
    tokens: list[str],
    scores: list[float],
    types: list[int],
    *,
    add_bos: bool,
    space_prefix: bool,
    pad_token_id: int | None = None,
) -> None:
    """A SentencePiece-style (`llama`) vocabulary laid out as `spm_tokens` lays it out (<unk>,
    <s>, </s> first), plus what the caller appends."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if pad_token_id is not None:
        writer.add_pad_token_id(pad_token_id)
    writer.add_add_bos_token(add_bos)
    writer.add_add_space_prefix(space_prefix)


def write_spm_tokenizer_gguf(out_file: Path, *, add_bos: bool = True) -> Path:
    tokens, scores, types = spm_tokens()
    writer = gguf.GGUFWriter(str(out_file), "llama")
    add_spm_tokenizer(writer, tokens, scores, types, add_bos=add_bos, space_prefix=True)
    return finish(writer, out_file)
