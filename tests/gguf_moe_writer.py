"""Write tiny Qwen3-MoE / DeepSeek-V2 / V3 checkpoints as GGUF the way llama.cpp's
convert_hf_to_gguf.py does (Qwen3MoeModel, DeepseekV2Model): its metadata keys, tensor names from
gguf's `TensorNameMap`, each layer's experts stacked into `ffn_{gate,up,down}_exps`
[n_expert, rows, cols], routers (`ffn_gate_inp`) kept F32, DeepSeek's `num_key_value_heads`
written as 1, key / value lengths of the latent (plus the `_mla` per-head ones), yarn's
`mscale_all_dim` as a 0.1-scaled log multiplier, and `kv_b_proj` split per head into
`attn_k_b` (transposed) and `attn_v_b` (`split_kv_b=False`: one `attn_kv_b`, as older converters
wrote). The tokenizer is tests/gguf_writer.py's byte-level BPE with its chat template.

One liberty: transformers' DeepSeek-V3 config has no `scoring_func`, which the released V3
config.json carries ("sigmoid") and the converter writes as `expert_gating_func`; it is written
here for V3 as the converter writes it for the released models.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType
from safetensors.numpy import load_file

from tests.gguf_writer import add_gpt2_tokenizer, add_shape, add_tensor, finish, tensor_namer

ARCH = {
    "Qwen3MoeForCausalLM": "qwen3moe",
    "DeepseekV2ForCausalLM": "deepseek2",
    "DeepseekV3ForCausalLM": "deepseek2",
}
_MODEL_ARCH = {"qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "deepseek2": gguf.MODEL_ARCH.DEEPSEEK2}
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight")


def _common(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    params = c.get("rope_parameters") or {}
    add_shape(w, c)
    w.add_rope_freq_base(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if params.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        for key, add in (
            ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
        ):
            if key in params:
                add(params[key])
        if params.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])


def _qwen3moe(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_expert_count(c.get("num_experts") or c["num_local_experts"])


def _deepseek2(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    kv_lora, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
    w.add_head_count_kv(1)  # MLA as MQA over the latent
    w.add_leading_dense_block_count(c.get("first_k_dense_replace") or 0)
    if c.get("q_lora_rank") is not None:
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(c["qk_nope_head_dim"] + rope)
    w.add_value_length_mla(c["v_head_dim"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_shared_count(c.get("n_shared_experts") or 0)
    w.add_expert_weights_scale(c.get("routed_scaling_factor", 1.0))
    if c.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    if c.get("n_group") is not None:
        w.add_expert_group_count(c["n_group"])
    if c.get("topk_group") is not None:
        w.add_expert_group_used_count(c["topk_group"])
    if c["architectures"][0] == "DeepseekV3ForCausalLM":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_rope_dimension_count(rope)


def _tensors(checkpoint: Path, c: dict[str, Any], split_kv_b: bool) -> dict[str, np.ndarray]:
    """HF name -> array, each layer's experts stacked and kv_b_proj split as the converter does."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, t in load_file(str(checkpoint / "model.safetensors")).items():
        match = _EXPERT.fullmatch(name)
        if match:
            stacked = f"{match.group(1)}.{match.group(3)}.weight"
            experts.setdefault(stacked, {})[int(match.group(2))] = t
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            heads, nope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"]
            kv_b = t.reshape(heads, nope + v, t.shape[-1])
            out[name.replace("kv_b_proj", "k_b_proj")] = kv_b[:, :nope].transpose(0, 2, 1)
            out[name.replace("kv_b_proj", "v_b_proj")] = kv_b[:, nope:]
        elif name.endswith("e_score_correction_bias"):
            out[name.removesuffix("_bias") + ".bias"] = t
        else:
            out[name] = t
    for stacked, members in experts.items():
        out[stacked] = np.stack([members[e] for e in sorted(members)])
    return out


def _add(w: gguf.GGUFWriter, name: str, t: np.ndarray, qtype: GGMLQuantizationType) -> None:
    size = gguf.GGML_QUANT_SIZES[qtype][0]
    if ".ffn_gate_inp." in name:
        qtype = GGMLQuantizationType.F32  # the converter keeps routers F32
    elif t.shape[-1] % size:
        qtype = GGMLQuantizationType.F16  # the converter's fallback for rows of odd length
    if qtype == GGMLQuantizationType.F16 and t.ndim > 1:
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float16))
        return
    add_tensor(w, name, t, qtype)


def write_moe_gguf(
    checkpoint: Path,
    out_file: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    *,
    split_kv_b: bool = True,
) -> Path:
    c = json.loads((checkpoint / "config.json").read_text())
    arch = ARCH[c["architectures"][0]]
    w = gguf.GGUFWriter(str(out_file), arch)
    _common(w, c)
    _qwen3moe(w, c) if arch == "qwen3moe" else _deepseek2(w, c)
    add_gpt2_tokenizer(w, add_bos=True, chat_template=True)
    gguf_name = tensor_namer(_MODEL_ARCH[arch], c["num_hidden_layers"])
    for hf_name, t in sorted(_tensors(checkpoint, c, split_kv_b).items()):
        _add(w, gguf_name(hf_name), t, qtype)
    return finish(w, out_file)


def quantized_checkpoint(
    checkpoint: Path, out_dir: Path, qtype: GGMLQuantizationType, *, split_kv_b: bool = True
) -> Path:
    """A copy of `checkpoint` whose weights are what `write_moe_gguf(..., qtype)` stores,
    dequantized: the Hugging Face model a quantized file describes exactly."""
    from safetensors.numpy import save_file

    c = json.loads((checkpoint / "config.json").read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        if item.name != "model.safetensors":
            (out_dir / item.name).write_bytes(item.read_bytes())
    weights = {}
    for name, t in load_file(str(checkpoint / "model.safetensors")).items():
        gguf_qtype = qtype
        if name.endswith("mlp.gate.weight") or t.ndim == 1:
            gguf_qtype = GGMLQuantizationType.F32
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            weights[name] = _kv_b_round_trip(t, c, qtype)
            continue
        weights[name] = _round_trip(t, gguf_qtype)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _round_trip(t: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    t = np.ascontiguousarray(t, dtype=np.float32)
    if qtype == GGMLQuantizationType.F32:
        return t
    if qtype == GGMLQuantizationType.F16 or t.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return t.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(t, qtype), qtype).reshape(t.shape)


def _kv_b_round_trip(t: np.ndarray, c: dict[str, Any], qtype: GGMLQuantizationType) -> np.ndarray:
    """kv_b_proj as the split attn_k_b (transposed) and attn_v_b store it."""
    heads, nope = c["num_attention_heads"], c["qk_nope_head_dim"]
    kv_b = t.reshape(heads, -1, t.shape[-1])
    k_b = _round_trip(kv_b[:, :nope].transpose(0, 2, 1), qtype).transpose(0, 2, 1)
    v_b = _round_trip(kv_b[:, nope:], qtype)
    return np.concatenate([k_b, v_b], axis=1).reshape(t.shape)
