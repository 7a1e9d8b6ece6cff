"""The Phi-3 family: `Phi3ForCausalLM` (GGUF `phi3`), Phi-4-mini included.

As transformers' modeling_phi3: a Llama layer whose checkpoint stacks q/k/v in one `qkv_proj` and
gate/up in one `gate_up_proj` (split row-wise at load time into the parameters the fused GEMMs
already run), partial rotary when `partial_rotary_factor` < 1, a window on every layer when
`sliding_window` is set. `longrope` scaling (the 128k-context variants) switches frequencies with
the sequence length and is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.model.config import ModelConfig
from shared.model.family import Family, FusedTensor
from shared.model.hf_config import (
    activation,
    common_fields,
    common_to_hf,
    rope_from_params,
    rope_params,
)

PHI3 = "Phi3ForCausalLM"
_LONGROPE = ("longrope", "su", "yarn")
FUSED_TENSORS = (
    FusedTensor(
        "self_attn.qkv_proj.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    FusedTensor("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
)


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    fields = common_fields(d, {"rms_norm_eps": 1e-5})
    params = rope_params(d)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in _LONGROPE:
        raise ValueError(
            f"Phi-3 rope scaling {rope_type!r} (longrope, the 128k-context variants) is not "
            "supported; the 4k-context models are"
        )
    theta, scaling = rope_from_params(params, d)
    factor = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    window = d.get("sliding_window")
    return ModelConfig(
        **fields,
        hidden_act=activation(d),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=None if factor == 1.0 else int(fields["head_dim"] * factor),
        sliding_window=int(window) if window else None,
        sliding_window_layers=tuple(range(fields["num_layers"])) if window else (),
    )


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    if c.sliding_window is not None and len(c.sliding_window_layers) != c.num_layers:
        raise ValueError("Phi-3 windows every layer or none; cannot export a per-layer window")
    return common_to_hf(c, "phi3") | {
        "hidden_act": c.hidden_act,
        "partial_rotary_factor": c.rotated_dims / c.head_dim,
        "sliding_window": c.sliding_window,
    }


FAMILY = Family(
    name="phi3",
    hf_architectures=(PHI3,),
    gguf_architectures={"phi3": PHI3},  # see gguf_arch.py
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    fused_tensors=FUSED_TENSORS,
)
