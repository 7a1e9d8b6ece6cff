"""llama.cpp's `gemma2`, `gemma3` and `phi3` GGUF architectures: their metadata as the
config.json their family reads, and which GGUF tensor fills which parameters.

The metadata becomes a Hugging Face config dict that the family's own `config_from_hf` maps, so a
GGUF file and a checkpoint directory of one model give the same `ModelConfig`. What llama.cpp
keeps outside the metadata is restored the way llama.cpp restores it:

- Gemma 2 alternates sliding / global layers, Gemma 3 has one global layer in six, unless
  `{arch}.attention.sliding_window_pattern` says otherwise (a period, or one bool per layer);
- Gemma's attention scale is `1/sqrt(head_dim)` except for the 27B models (llama.cpp's
  `LLM_TYPE_27B`: 46 layers for Gemma 2, 62 for Gemma 3), which use `1/sqrt(hidden / heads)`;
  an explicit `{arch}.attention.scale` wins;
- Gemma 3's sliding layers rotate with base 10000 (`rope.freq_base_swa` when present), never
  scaled; only its global layers take `rope.scaling.*`;
- Phi-3's partial rotary is `rope.dimension_count` of `hidden / heads`, its window
  `attention.sliding_window` (0: none), and `rope_factors_long/short` mark the longrope models.

Tensor names come from gguf's own `TensorNameMap` applied to the family's checkpoint names, so
Phi-3's fused `attn_qkv` / `ffn_up` (gate rows first) fill q/k/v and gate/up row-wise. llama.cpp's
converter stores every Gemma `*norm.weight` plus one (ggml multiplies by the weight where
Gemma's RMSNorm multiplies by `1 + weight`); that one is taken off again here. Neither family's
Q/K rows are permuted (both rotate NEOX-style, halves like Hugging Face's `rotate_half`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import gguf as gg

from shared.model.gguf_file import GgufFile
from shared.model.hf_config import FULL_ATTENTION, SLIDING_ATTENTION
from shared.model.registry import family_for

GEMMA2, GEMMA3, PHI3 = "gemma2", "gemma3", "phi3"
ARCHES = {GEMMA2: "Gemma2ForCausalLM", GEMMA3: "Gemma3ForCausalLM", PHI3: "Phi3ForCausalLM"}
# archs whose norm weights llama.cpp's converter stores as 1 + weight
NORM_SHIFTED = frozenset({GEMMA2, GEMMA3})
_MODEL_ARCH = {GEMMA2: gg.MODEL_ARCH.GEMMA2, GEMMA3: gg.MODEL_ARCH.GEMMA3, PHI3: gg.MODEL_ARCH.PHI3}
_GEMMA_PERIOD = {GEMMA2: 2, GEMMA3: 6}
_GEMMA_27B_LAYERS = {GEMMA2: 46, GEMMA3: 62}
_LOCAL_ROPE_BASE = 10_000.0
_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def hf_config(g: GgufFile, eos_token_ids: tuple[int, ...]) -> dict[str, Any]:
    """The config.json of the model in `g` (architecture in ARCHES)."""
    arch = g.architecture
    d = base_config(g, eos_token_ids) | {"architectures": [ARCHES[arch]]}
    heads, hidden = d["num_attention_heads"], d["hidden_size"]
    layers, head_dim = d["num_hidden_layers"], d["head_dim"]
    if arch == PHI3:
        return d | _phi3(g, head_dim)
    return d | _gemma(g, arch, layers, heads, hidden, head_dim)


def base_config(g: GgufFile, eos_token_ids: tuple[int, ...]) -> dict[str, Any]:
    """The config.json keys every architecture's `{arch}.*` metadata gives alike."""
    arch = g.architecture
    heads = int(g.require(f"{arch}.attention.head_count"))
    hidden = int(g.require(f"{arch}.embedding_length"))
    layers = int(g.require(f"{arch}.block_count"))
    head_dim = int(g.get(f"{arch}.attention.key_length") or hidden // heads)
    embed = g.tensors.get("token_embd.weight")
    if embed is None:
        raise g.error("lacks tensor 'token_embd.weight'")
    tokens = g.get("tokenizer.ggml.tokens")
    return {
        "vocab_size": int(
            g.get(f"{arch}.vocab_size") or (len(tokens) if tokens else int(embed.shape[1]))
        ),
        "hidden_size": hidden,
        "intermediate_size": int(g.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(g.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(g.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(g.get(f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "bos_token_id": g.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(eos_token_ids),
        "pad_token_id": g.get("tokenizer.ggml.padding_token_id"),
    }


def _gemma(
    g: GgufFile, arch: str, layers: int, heads: int, hidden: int, head_dim: int
) -> dict[str, Any]:
    d: dict[str, Any] = {
        "query_pre_attn_scalar": _query_pre_attn_scalar(g, arch, layers, heads, hidden, head_dim),
        "layer_types": _layer_types(g, arch, layers),
        "sliding_window": int(g.get(f"{arch}.attention.sliding_window") or 0) or None,
    }
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = g.get(f"{arch}.{key}")
        if value is not None:  # absent: llama.cpp's defaults, which are transformers' too
            d[key] = float(value)
    scaling = _rope_scaling(g, arch)
    if arch == GEMMA2:
        if scaling:
            raise g.error(f"Gemma 2 with rope scaling {scaling} is not supported")
        return d | {"rope_theta": float(g.get(f"{arch}.rope.freq_base", _LOCAL_ROPE_BASE))}
    full = {"rope_type": "default", **scaling}
    full["rope_theta"] = float(g.get(f"{arch}.rope.freq_base", 1_000_000.0))
    local = {
        "rope_type": "default",
        "rope_theta": float(g.get(f"{arch}.rope.freq_base_swa", _LOCAL_ROPE_BASE)),
    }
    return d | {"rope_parameters": {FULL_ATTENTION: full, SLIDING_ATTENTION: local}}


def _query_pre_attn_scalar(
    g: GgufFile, arch: str, layers: int, heads: int, hidden: int, head_dim: int
) -> float:
    scale = g.get(f"{arch}.attention.scale")
    if scale is not None:
        return float(scale) ** -2
    return hidden / heads if layers == _GEMMA_27B_LAYERS[arch] else float(head_dim)


def _layer_types(g: GgufFile, arch: str, layers: int) -> list[str]:
    pattern = g.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise g.error(f"sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        # llama.cpp's set_swa_pattern(n): layer i slides unless it is the last of each n
        period = int(pattern or _GEMMA_PERIOD[arch])
        sliding = [i % period < period - 1 for i in range(layers)]
    return [SLIDING_ATTENTION if s else FULL_ATTENTION for s in sliding]


def _rope_scaling(g: GgufFile, arch: str) -> dict[str, Any]:
    kind = str(g.get(f"{arch}.rope.scaling.type", "none") or "none")
    factor = float(g.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "none" or factor == 1.0:
        return {}
    if kind != "linear":
        raise g.error(f"unsupported rope scaling {kind!r} (factor {factor}) for {arch}")
    return {"rope_type": "linear", "factor": factor}


def _phi3(g: GgufFile, head_dim: int) -> dict[str, Any]:
    longrope = [name for name in _LONGROPE_TENSORS if name in g.tensors]
    if longrope:
        raise g.error(
            f"has {longrope}: Phi-3 longrope (the 128k-context variants) is not supported"
        )
    if _rope_scaling(g, PHI3):
        raise g.error("Phi-3 with rope scaling is not supported")
    rope_dims = int(g.get(f"{PHI3}.rope.dimension_count") or head_dim)
    if not 0 < rope_dims <= head_dim or rope_dims % 2:
        raise g.error(f"rope.dimension_count {rope_dims} does not fit head_dim {head_dim}")
    return {
        "hidden_act": "silu",
        "rope_theta": float(g.get(f"{PHI3}.rope.freq_base", 10_000.0)),
        "partial_rotary_factor": rope_dims / head_dim,
        "sliding_window": int(g.get(f"{PHI3}.attention.sliding_window") or 0) or None,
    }


def tensor_targets(arch: str, architecture: str, params: Collection[str]) -> dict[str, list[str]]:
    """GGUF tensor name -> the parameters it fills, in row order (several for a fused tensor).
    `architecture`: the Hugging Face name the file loads as."""
    names = gg.get_tensor_name_map(_MODEL_ARCH[arch], num_layers(params))
    targets: dict[str, list[str]] = {}
    for checkpoint, parts in family_for(architecture).checkpoint_layout(params).items():
        name = names.get_name(checkpoint, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"{arch} GGUF has no tensor name for {checkpoint}")
        targets[name] = parts
    return targets


def num_layers(params: Collection[str]) -> int:
    layers = [int(p.split(".")[2]) for p in params if p.startswith("model.layers.")]
    return max(layers, default=-1) + 1
