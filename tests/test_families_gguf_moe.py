"""GGUF `qwen3moe` and `deepseek2`, written the way llama.cpp converts (tests/gguf_moe_writer.py):
F32 files give the same config (but for what the file spells otherwise) and the same greedy tokens
over 14 prompts as pdserve's run of the source checkpoint: Qwen3-MoE, DeepSeek-V3 (grouped sigmoid
routing with `exp_probs_b`, q LoRA, a dense first layer, shared experts, split `attn_k_b` /
`attn_v_b`) and DeepSeek-V2 (softmax routing, no q LoRA, yarn, one `attn_kv_b`). Q8_0 files give
the tokens of the source checkpoint with its weights replaced by what the file stores, and, for
Qwen3-MoE, of transformers reading the file; `export-hf` writes each back as a directory
pdserve loads to the same config and weights. The tokenizer and chat template come from the file;
what llama.cpp would run otherwise than the metadata says fails at load."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pdserve.export_hf import export_hf
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.config import ModelConfig
from shared.model.gguf_file import GgufError
from shared.model.loader import load_model
from tests.engine_helpers import hf_greedy_with, single_torch_thread
from tests.gguf_moe_writer import quantized_checkpoint, write_moe_gguf
from tests.test_families_parity import engine_config, family_prompts

MAX_TOKENS = 8
_MLA = {
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}
# mscale = mscale_all_dim, as in the released models: llama.cpp has no key for a different one
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 16.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 64,
}
# (arch, checkpoint overrides, split kv_b_proj as today's converter does)
VARIANTS: dict[str, tuple[str, dict[str, object], bool]] = {
    "qwen3moe-8x3-gqa": (
        "qwen3_moe",
        {
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "head_dim": 32,
            "norm_topk_prob": True,
        },
        True,
    ),
    "qwen3moe-4x2-yarn": (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "head_dim": 16,
            "norm_topk_prob": True,
            "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        True,
    ),
    "deepseek-v3-grouped-qlora-split-kv-b": (
        "deepseek_v3",
        _MLA
        | {
            "q_lora_rank": 48,
            "n_routed_experts": 8,
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_shared_experts": 2,
        },
        True,
    ),
    "deepseek-v2-lite-yarn-kv-b": (
        "deepseek_v2",
        _MLA
        | {
            "q_lora_rank": None,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_shared_experts": 2,
            "topk_method": "greedy",
            "routed_scaling_factor": 1.5,
            "rope_parameters": YARN,
        },
        False,
    ),
}
# inside what transformers' GGUF reader maps: it has no key for moe_intermediate_size and takes
# its default, 768 (Qwen3-30B-A3B's)
TRANSFORMERS_READABLE = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 768,
    "head_dim": 32,
    "norm_topk_prob": True,
}


def _tokens(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(engine_config(path), load_model(str(path), dtype=torch.float32))
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    llm.check_conservation()
    return [out.token_ids for out in outputs]


def _as_source(got: ModelConfig, source: ModelConfig) -> ModelConfig:
    """`got` with what a GGUF file spells otherwise taken from `source`: another vocabulary's
    special ids, float32 epsilon and yarn multiplier; the rest must be equal."""
    ids = ("bos_token_id", "eos_token_ids", "pad_token_id", "rms_norm_eps")
    fixed = replace(got, **{k: getattr(source, k) for k in ids})
    if got.mla is not None and source.mla is not None:
        assert math.isclose(got.mla.softmax_scale, source.mla.softmax_scale, rel_tol=1e-6)
        scale = got.rope_scaling.mscale_all_dim
        assert math.isclose(scale, source.rope_scaling.mscale_all_dim, rel_tol=1e-6)
        fixed = replace(fixed, mla=source.mla, rope_scaling=source.rope_scaling)
    return fixed


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gguf_serves_the_source_checkpoints_tokens(
    name: str, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    arch, kwargs, split = VARIANTS[name]
    source = checkpoint(arch, **kwargs)
    path = write_moe_gguf(source, tmp_path / f"{name}.gguf", Q.F32, split_kv_b=split)
    got, want = load_model(str(path)).config, load_model(str(source)).config
    assert _as_source(got, want) == want
    prompts = family_prompts(seed=21)
    with single_torch_thread():
        assert _tokens(path, prompts) == _tokens(source, prompts)
    export_hf(str(path), tmp_path / "hf")
    a, b = load_model(str(path)), load_model(str(tmp_path / "hf"))
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert a.config == b.config and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_q8_0_gguf_serves_the_weights_it_stores(
    name: str, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Routers stay F32 and rows whose length is no multiple of 32 (attn_k_b's) F16, as the
    converter stores them; every other matrix is Q8_0."""
    arch, kwargs, split = VARIANTS[name]
    source = checkpoint(arch, **kwargs)
    path = write_moe_gguf(source, tmp_path / f"{name}.gguf", Q.Q8_0, split_kv_b=split)
    stored = quantized_checkpoint(source, tmp_path / "stored", Q.Q8_0, split_kv_b=split)
    a, b = load_model(str(path), dtype=torch.float32), load_model(str(stored), dtype=torch.float32)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and [k for k in sa if not torch.equal(sa[k], sb[k])] == []
    prompts = family_prompts(seed=22)
    with single_torch_thread():
        assert _tokens(path, prompts) == _tokens(stored, prompts)


def test_q8_0_qwen3moe_matches_transformers_reading_the_file(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    source = checkpoint("qwen3_moe", **TRANSFORMERS_READABLE)
    path = write_moe_gguf(source, tmp_path / "qwen3moe.gguf", Q.Q8_0)
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompts = family_prompts(seed=23)
    with single_torch_thread():
        want = [hf_greedy_with(reference, p, MAX_TOKENS, eos_token_id=None) for p in prompts]
        assert _tokens(path, prompts) == want


def test_tokenizer_and_chat_template_come_from_the_file(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    arch, kwargs, split = VARIANTS["deepseek-v3-grouped-qlora-split-kv-b"]
    path = write_moe_gguf(checkpoint(arch, **kwargs), tmp_path / "v3.gguf", split_kv_b=split)
    loaded = load_model(str(path))
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("Hello world")) == "Hello world"
    assert loaded.chat_template is not None
    text = loaded.chat_template.render([{"role": "user", "content": "hi"}])
    assert text == "<s><|user|>hi</s><|assistant|>"


def _rewrite(path: Path, out: Path, key: str, value: object) -> Path:
    """`path` with metadata `key` set to `value` (a bool or a uint32; None: dropped)."""
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(out), str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", key):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif value is not None:
        w.add_uint32(key, int(value))  # type: ignore[call-overload]
    for t in reader.tensors:
        w.add_tensor(
            t.name,
            t.data,
            raw_shape=list(reversed([int(d) for d in t.shape])),
            raw_dtype=t.tensor_type,
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize(
    ("name", "key", "value", "problem"),
    [
        (
            "deepseek-v3-grouped-qlora-split-kv-b",
            "deepseek2.expert_gating_func",
            3,
            "unsupported expert_gating_func 3",
        ),
        (
            "deepseek-v2-lite-yarn-kv-b",
            "deepseek2.expert_weights_norm",
            True,
            "softmax routing with expert_weights_norm is not supported",
        ),
        (
            "deepseek-v2-lite-yarn-kv-b",
            "deepseek2.expert_group_count",
            2,
            "softmax routing over 2 expert groups is not supported",
        ),
    ],
)
def test_what_llama_cpp_would_run_otherwise_fails_at_load(
    name: str,
    key: str,
    value: object,
    problem: str,
    checkpoint: Callable[..., Path],
    tmp_path: Path,
) -> None:
    arch, kwargs, split = VARIANTS[name]
    path = write_moe_gguf(checkpoint(arch, **kwargs), tmp_path / "ok.gguf", split_kv_b=split)
    bad = _rewrite(path, tmp_path / "bad.gguf", key, value)
    with pytest.raises(GgufError, match=re.escape(problem)):
        load_model(str(bad))


def test_deepseek2_yarn_without_log_multiplier_scales_neither_rope_nor_softmax(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """llama.cpp cancels ggml's yarn factor on cos/sin for deepseek2 whatever the multiplier;
    without one the softmax keeps qk_head_dim ** -0.5 (transformers would scale cos/sin)."""
    arch, kwargs, split = VARIANTS["deepseek-v2-lite-yarn-kv-b"]
    path = write_moe_gguf(checkpoint(arch, **kwargs), tmp_path / "ok.gguf", split_kv_b=split)
    key = "deepseek2.rope.scaling.yarn_log_multiplier"
    config = load_model(str(_rewrite(path, tmp_path / "plain.gguf", key, None))).config
    assert config.rope_scaling.rope_type == "yarn" and config.rope_scaling.factor == 16.0
    assert config.rope_scaling.attention_factor == 1.0
    assert config.mla is not None and config.mla.softmax_scale == config.mla.qk_head_dim**-0.5
