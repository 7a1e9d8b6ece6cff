"""llama.cpp's `qwen3moe` and `deepseek2` GGUF architectures: their metadata as the config.json
their family reads, and which GGUF tensor fills which parameters.

As llama.cpp reads them (src/llama-model.cpp, src/models/{qwen3moe,deepseek2}.cpp):

- `qwen3moe`: every layer is experts (`expert_count`, `expert_used_count`,
  `expert_feed_forward_length`), a softmax router whose top-k weights llama.cpp always
  renormalises, whatever the source's `norm_topk_prob`; q/k norms; no shared expert.
- `deepseek2`: latent attention (`attention.q_lora_rank`, absent without a q LoRA,
  `attention.kv_lora_rank`, `rope.dimension_count` for the rope part, `attention.key_length_mla`
  / `value_length_mla` for the per-head sizes; files older than those keys give them as
  `key_length` / `value_length`), rope on interleaved pairs (llama.cpp's NORM rope), the first
  `leading_dense_block_count` layers dense, `expert_shared_count` shared experts,
  `expert_weights_scale`, `expert_weights_norm`, expert groups (ranked by their two best
  scores). `expert_gating_func` sigmoid is DeepSeek-V3 (with `exp_probs_b`, its
  `e_score_correction_bias`); softmax, or no key (files written before it existed), is
  DeepSeek-V2 routing greedily. A softmax file with groups or renormalised weights fails at
  load: llama.cpp would run what neither transformers nor pdserve's V2 router computes.
- yarn: deepseek2's `rope.scaling.yarn_log_multiplier` is 0.1 * `mscale_all_dim`
  (convert_hf_to_gguf.py's legacy spelling); llama.cpp cancels yarn's cos/sin factor (as
  transformers does when `mscale` = `mscale_all_dim`) and scales the softmax by
  mscale(`mscale_all_dim`) squared. qwen3moe's is ggml's plain yarn, transformers' default one.

Expert weights come stacked, `ffn_{gate,up,down}_exps` [n_expert, rows, cols], and fill the
experts' rows in expert order. Newer converters split `kv_b_proj` per head into `attn_k_b`
(the key rows, transposed: [heads, kv_lora_rank, nope]) and `attn_v_b` ([heads, v, kv_lora_rank])
for llama.cpp's absorbed attention; both are written back into `kv_b_proj` here (`fill_kv_b`).
Older files carry `attn_kv_b` as is. Neither architecture's Q/K rows are permuted.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

import gguf as gg
import torch

from shared.model.config import ModelConfig
from shared.model.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from shared.model.gguf_arch import base_config, num_layers
from shared.model.gguf_file import GgufFile
from shared.model.qwen3_moe import QWEN3_MOE
from shared.model.registry import family_for

QWEN3MOE, DEEPSEEK2 = "qwen3moe", "deepseek2"
ARCHES = frozenset({QWEN3MOE, DEEPSEEK2})
_MODEL_ARCH = {QWEN3MOE: gg.MODEL_ARCH.QWEN3MOE, DEEPSEEK2: gg.MODEL_ARCH.DEEPSEEK2}
# convert_hf_to_gguf.py writes yarn_log_multiplier as 0.1 * mscale_all_dim for deepseek2
_YARN_LOG_MUL_SCALE = 0.1
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
_SPLIT_KV_B = re.compile(r"blk\.\d+\.attn_([kv])_b\.weight")


def hf_config(g: GgufFile, eos_token_ids: tuple[int, ...]) -> dict[str, Any]:
    """The config.json of the model in `g` (architecture in ARCHES)."""
    arch = g.architecture
    d = base_config(g, eos_token_ids)
    theta = float(g.get(f"{arch}.rope.freq_base", 10_000.0))
    scaling = _rope_scaling(g, arch)
    d |= {
        "num_experts_per_tok": int(g.require(f"{arch}.expert_used_count")),
        "moe_intermediate_size": int(g.require(f"{arch}.expert_feed_forward_length")),
        "rope_theta": theta,
    }
    if scaling:
        d["rope_parameters"] = scaling | {"rope_theta": theta}
    if arch == QWEN3MOE:
        return d | {
            "architectures": [QWEN3_MOE],
            "num_experts": int(g.require(f"{arch}.expert_count")),
            "norm_topk_prob": True,  # llama.cpp's qwen3moe graph renormalises always
        }
    return d | _deepseek(g, arch)


def _deepseek(g: GgufFile, arch: str) -> dict[str, Any]:
    gating = int(g.get(f"{arch}.expert_gating_func") or gg.ExpertGatingFuncType.SOFTMAX)
    if gating not in (gg.ExpertGatingFuncType.SOFTMAX, gg.ExpertGatingFuncType.SIGMOID):
        raise g.error(
            f"unsupported expert_gating_func {gating}; supported: 1 (softmax), 2 (sigmoid)"
        )
    v3 = gating == gg.ExpertGatingFuncType.SIGMOID
    norm = bool(g.get(f"{arch}.expert_weights_norm", False))
    if norm and not v3:
        raise g.error(
            "softmax routing with expert_weights_norm is not supported (DeepSeek-V2 "
            "never renormalises)"
        )
    groups = int(g.get(f"{arch}.expert_group_count") or 1)
    if groups > 1 and not v3:
        # llama.cpp ranks groups by their two best scores for every arch; DeepSeek-V2's
        # group_limited_greedy (transformers, pdserve's softmax router) by the best one
        raise g.error(f"softmax routing over {groups} expert groups is not supported")
    rope = int(g.require(f"{arch}.rope.dimension_count"))
    qk = g.get(f"{arch}.attention.key_length_mla") or g.require(f"{arch}.attention.key_length")
    v = g.get(f"{arch}.attention.value_length_mla") or g.require(f"{arch}.attention.value_length")
    q_lora = g.get(f"{arch}.attention.q_lora_rank")
    d: dict[str, Any] = {
        "architectures": [DEEPSEEK_V3 if v3 else DEEPSEEK_V2],
        "kv_lora_rank": int(g.require(f"{arch}.attention.kv_lora_rank")),
        "q_lora_rank": None if q_lora is None else int(q_lora),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(qk) - rope,
        "v_head_dim": int(v),
        "n_routed_experts": int(g.require(f"{arch}.expert_count")),
        "n_shared_experts": int(g.get(f"{arch}.expert_shared_count") or 0),
        "first_k_dense_replace": int(g.get(f"{arch}.leading_dense_block_count") or 0),
        "routed_scaling_factor": float(g.get(f"{arch}.expert_weights_scale") or 1.0),
        "norm_topk_prob": norm,
        "n_group": groups,
        "topk_group": int(g.get(f"{arch}.expert_group_used_count") or 1),
        "topk_method": "group_limited_greedy" if groups > 1 else "greedy",
    }
    if v3:
        d["rope_interleave"] = True  # llama.cpp rotates every deepseek2 in pairs
    return d


def _rope_scaling(g: GgufFile, arch: str) -> dict[str, Any]:
    kind = str(g.get(f"{arch}.rope.scaling.type", "none") or "none")
    factor = float(g.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "none" or factor == 1.0:
        return {}
    if kind != "yarn":
        raise g.error(f"unsupported rope scaling {kind!r} (factor {factor}) for {arch}")
    if float(g.get(f"{arch}.rope.scaling.attn_factor") or 1.0) != 1.0:
        raise g.error("yarn with rope.scaling.attn_factor other than 1 is not supported")
    yarn = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": int(
            g.require(f"{arch}.rope.scaling.original_context_length")
        ),
        "beta_fast": float(g.get(f"{arch}.rope.scaling.yarn_beta_fast") or 32.0),
        "beta_slow": float(g.get(f"{arch}.rope.scaling.yarn_beta_slow") or 1.0),
    }
    if arch == QWEN3MOE:
        return yarn  # ggml scales cos/sin by mscale(factor), as transformers' default yarn
    mscale_all_dim = float(g.get(f"{arch}.rope.scaling.yarn_log_multiplier") or 0.0)
    mscale_all_dim /= _YARN_LOG_MUL_SCALE
    # llama.cpp cancels yarn's cos/sin factor; only the softmax takes mscale_all_dim
    return yarn | {
        "attention_factor": 1.0,
        "mscale": mscale_all_dim,
        "mscale_all_dim": mscale_all_dim,
    }


def tensor_targets(g: GgufFile, architecture: str, params: Collection[str]) -> dict[str, list[str]]:
    """GGUF tensor name -> the parameters it fills, in row order (each expert's in turn for a
    stacked tensor). `architecture`: the Hugging Face name the file loads as."""
    names = gg.get_tensor_name_map(_MODEL_ARCH[g.architecture], num_layers(params))
    targets: dict[str, list[str]] = {}
    experts: dict[str, list[tuple[int, str]]] = {}
    for checkpoint, parts in family_for(architecture).checkpoint_layout(params).items():
        expert = _EXPERT.fullmatch(checkpoint)
        if expert:
            layer, index, proj = expert.groups()
            stacked = names.get_name(
                f"model.layers.{layer}.mlp.experts.{proj}.weight", try_suffixes=(".weight",)
            )
            if stacked is None:
                raise ValueError(f"{g.architecture} GGUF has no tensor name for {checkpoint}")
            experts.setdefault(stacked, []).append((int(index), parts[0]))
            continue
        for name in _gguf_names(g, names, checkpoint):
            targets.setdefault(name, []).extend(parts)
    for stacked, members in experts.items():
        targets[stacked] = [param for _, param in sorted(members)]
    return targets


def _gguf_names(g: GgufFile, names: gg.TensorNameMap, checkpoint: str) -> list[str]:
    layer = checkpoint.split(".")[2] if checkpoint.startswith("model.layers.") else ""
    if checkpoint.endswith("mlp.gate.e_score_correction_bias"):
        return [f"blk.{layer}.exp_probs_b.bias"]
    # today's converter splits kv_b_proj; older files keep it whole
    split = f"blk.{layer}.attn_kv_b.weight" not in g.tensors
    if checkpoint.endswith("self_attn.kv_b_proj.weight") and split:
        return [f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"]
    name = names.get_name(checkpoint, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"{g.architecture} GGUF has no tensor name for {checkpoint}")
    return [name]


def is_split_kv_b(name: str) -> bool:
    """Whether GGUF tensor `name` is half of a split `kv_b_proj` (`fill_kv_b` loads it)."""
    return _SPLIT_KV_B.fullmatch(name) is not None


def fill_kv_b(name: str, values: torch.Tensor, kv_b: torch.Tensor, config: ModelConfig) -> None:
    """Write `attn_k_b` ([heads, kv_lora_rank, nope], the key rows transposed) or `attn_v_b`
    ([heads, v, kv_lora_rank]) into their rows of `kv_b` [heads * (nope + v), kv_lora_rank]."""
    assert config.mla is not None
    m, heads = config.mla, config.num_heads
    per_head = kv_b.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    match = _SPLIT_KV_B.fullmatch(name)
    assert match is not None
    if match.group(1) == "k":
        rows, values = per_head[:, : m.qk_nope_head_dim], values.transpose(1, 2)
    else:
        rows = per_head[:, m.qk_nope_head_dim :]
    if values.shape != rows.shape:
        raise ValueError(
            f"tensor {name!r} holds {tuple(values.shape)} per-head rows, the metadata implies "
            f"{tuple(rows.shape)}"
        )
    with torch.no_grad():
        rows.copy_(values)
