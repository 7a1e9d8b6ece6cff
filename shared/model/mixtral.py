"""The Mixtral family: `MixtralForCausalLM`.

As transformers' modeling_mixtral: a Mistral layer (Llama attention, a window on every layer when
`sliding_window` is set) whose MLP is `num_local_experts` SwiGLU experts, `num_experts_per_tok`
of them per token, chosen by a softmax router and always renormalised (shared/model/router.py).
Checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up) and
w2 (down), as transformers' save_pretrained writes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.model.config import ModelConfig
from shared.model.family import Family, RenamedTensor
from shared.model.hf_config import activation, common_fields, common_to_hf, full_rotary_rope
from shared.model.moe_hf import mixtral_moe

MIXTRAL = "MixtralForCausalLM"
_DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072}
RENAMED_TENSORS = (
    RenamedTensor(r"mlp\.gate\.weight", "block_sparse_moe.gate.weight"),
    RenamedTensor(
        r"mlp\.experts\.(\d+)\.gate_proj\.weight", r"block_sparse_moe.experts.\1.w1.weight"
    ),
    RenamedTensor(
        r"mlp\.experts\.(\d+)\.down_proj\.weight", r"block_sparse_moe.experts.\1.w2.weight"
    ),
    RenamedTensor(
        r"mlp\.experts\.(\d+)\.up_proj\.weight", r"block_sparse_moe.experts.\1.w3.weight"
    ),
)


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    d = {**_DEFAULTS, **d}
    fields = common_fields(d)
    rope_theta, rope_scaling = full_rotary_rope(d)
    window = d.get("sliding_window")
    return ModelConfig(
        **fields,
        hidden_act=activation(d),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        sliding_window=int(window) if window else None,
        sliding_window_layers=tuple(range(fields["num_layers"])) if window else (),
        moe=mixtral_moe(d),
    )


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    moe = c.moe
    if moe is None or moe.dense_layers or moe.intermediate_size != c.intermediate_size:
        raise ValueError("Mixtral has experts of the model's intermediate size in every layer")
    if c.sliding_window is not None and len(c.sliding_window_layers) != c.num_layers:
        raise ValueError("Mixtral windows every layer or none; cannot export a per-layer window")
    return common_to_hf(c, "mixtral") | {
        "hidden_act": c.hidden_act,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "sliding_window": c.sliding_window,
    }


FAMILY = Family(
    name="mixtral",
    hf_architectures=(MIXTRAL,),
    gguf_architectures={},  # GGUF llama with experts: not yet
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    renamed_tensors=RENAMED_TENSORS,
)
