"""GGUF for the newer families: a Qwen3 checkpoint written the way llama.cpp converts it
(`qwen3` metadata with key/value lengths, per-head q/k norms as `attn_q_norm` / `attn_k_norm`,
Q/K rows unpermuted) serves transformers' greedy tokens, and `export-hf` writes it back as a
Qwen3 directory transformers runs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from pdserve.export_hf import export_hf
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.engine_helpers import hf_greedy, random_prompts, single_torch_thread
from tests.gguf_writer import (
    add_gpt2_tokenizer,
    add_shape,
    add_tensor,
    finish,
    gguf_name,
    gpt2_vocab_size,
)

QWEN3 = {
    "head_dim": 32,
    "num_key_value_heads": 1,
    "tie_word_embeddings": False,
    "vocab_size": gpt2_vocab_size(),
}
_NORMS = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def qwen3_gguf_name(hf_name: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    for hf_part, gguf_part in _NORMS.items():
        if base.endswith(hf_part):
            return f"blk.{base.split('.')[2]}.{gguf_part}.{suffix}"
    return gguf_name(hf_name)


def write_qwen3_gguf(checkpoint: Path, out_file: Path, qtype: Q) -> Path:
    config = json.loads((checkpoint / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out_file), "qwen3")
    add_shape(writer, config)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    add_gpt2_tokenizer(writer, add_bos=False, chat_template=False)
    for hf_name, w in sorted(load_file(str(checkpoint / "model.safetensors")).items()):
        add_tensor(writer, qwen3_gguf_name(hf_name), w, qtype)
    return finish(writer, out_file)


def test_qwen3_gguf_serves_transformers_tokens_and_exports(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    source = checkpoint("qwen3", **QWEN3)
    path = write_qwen3_gguf(source, tmp_path / "qwen3.gguf", Q.F32)
    loaded = load_model(str(path), dtype=torch.float32)
    assert loaded.config.architecture == "Qwen3ForCausalLM" and loaded.config.qk_norm
    prompts = random_prompts(4, gpt2_vocab_size() - 3, min_len=2, max_len=60, seed=3)
    with single_torch_thread():
        llm = LLM(EngineConfig(model=str(path), num_kv_blocks=256), loaded)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.token_ids == hf_greedy(source, prompt, 8, eos_token_id=None)
    llm.check_conservation()
    export_hf(str(path), tmp_path / "hf")
    a = load_model(str(source), dtype=torch.float32).model.state_dict()
    b = load_model(str(tmp_path / "hf"), dtype=torch.float32).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_quantized_qwen3_gguf_loads(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = write_qwen3_gguf(checkpoint("qwen3", **QWEN3), tmp_path / "q8.gguf", Q.Q8_0)
    loaded = load_model(str(path), dtype=torch.float32)
    llm = LLM(EngineConfig(model=str(path), num_kv_blocks=64), loaded)
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4
