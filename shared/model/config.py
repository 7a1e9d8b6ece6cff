"""Model hyper-parameters for the decoder-only architectures pdserve serves.

`ModelConfig` is the one description every role (prefill, decode, loader, engine) agrees on. It is
built either by hand (the built-in `tiny` model) or from a Hugging Face `config.json` via
`ModelConfig.from_hf_config_dict`, which accepts both the transformers 4.x spelling
(`rope_theta` + `rope_scaling`) and the 5.x spelling (`rope_parameters`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.engine.kv_cache import KvLayout, dtype_name

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3")

# transformers' `RotaryEmbeddingConfigMixin.default_theta`: used when a config names no theta.
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. Only `llama3` carries parameters; `default` means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}"
            )
        if self.rope_type == "llama3":
            if self.factor <= 0:
                raise ValueError(f"llama3 rope factor must be positive, got {self.factor}")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError(
                    "llama3 rope needs high_freq_factor > low_freq_factor, got "
                    f"{self.high_freq_factor} <= {self.low_freq_factor}"
                )
            if self.original_max_position_embeddings <= 0:
                raise ValueError("llama3 rope needs a positive original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = _DEFAULT_RMS_NORM_EPS
    rope_theta: float = _DEFAULT_ROPE_THETA
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # Bias on q/k/v projections (Qwen2: always; Llama: `attention_bias`).
    attention_bias: bool = False
    # Bias on o_proj: Llama's `attention_bias` covers o_proj too, Qwen2's qkv bias does not.
    attention_out_bias: bool = False
    mlp_bias: bool = False
    # Windowed attention (Mistral: every layer; Qwen2: layers >= max_window_layers when enabled).
    # A layer in `sliding_window_layers` lets position q attend to keys in (q - window, q].
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        self._validate()

    # ----------------------------------------------------------------------------- validation

    def _validate(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {list(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        self._validate_sliding_window()
        # pad is not checked: some real configs name a pad id outside the vocabulary, harmlessly.
        for token in (self.bos_token_id, *self.eos_token_ids):
            if token is not None and not 0 <= token < self.vocab_size:
                raise ValueError(f"special token id {token} outside vocab [0, {self.vocab_size})")

    def _validate_sliding_window(self) -> None:
        if self.sliding_window is None:
            if self.sliding_window_layers:
                raise ValueError("sliding_window_layers given without a sliding_window")
            return
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        bad = [i for i in self.sliding_window_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"sliding_window_layers {bad} outside [0, {self.num_layers})")

    # ------------------------------------------------------------------------------- queries

    def window_for_layer(self, layer: int) -> int | None:
        """The attention window of `layer`, or None for full causal attention."""
        if self.sliding_window is not None and layer in self.sliding_window_layers:
            return self.sliding_window
        return None

    @property
    def max_context_len(self) -> int:
        return self.max_position_embeddings

    def kv_layout(self, block_size: int, dtype: torch.dtype | str) -> KvLayout:
        name = dtype if isinstance(dtype, str) else dtype_name(dtype)
        return KvLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            dtype=name,
        )

    # ------------------------------------------------------------------------ from config.json

    @classmethod
    def from_hf_config_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Build from a parsed Hugging Face `config.json` (transformers 4.x or 5.x layout)."""
        architecture = _architecture(d)
        try:
            num_heads = int(d["num_attention_heads"])
            hidden_size = int(d["hidden_size"])
            num_layers = int(d["num_hidden_layers"])
            vocab_size = int(d["vocab_size"])
            intermediate_size = int(d["intermediate_size"])
        except KeyError as exc:
            raise ValueError(f"config.json lacks required key {exc.args[0]!r}") from None
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; only 'silu' is implemented")
        rope_theta, rope_scaling = _rope_from_dict(d)
        window, window_layers = _sliding_window_from_dict(architecture, d, num_layers)
        llama_bias = architecture == "LlamaForCausalLM" and bool(d.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=architecture == "Qwen2ForCausalLM" or llama_bias,
            attention_out_bias=llama_bias,
            mlp_bias=architecture == "LlamaForCausalLM" and bool(d.get("mlp_bias", False)),
            sliding_window=window,
            sliding_window_layers=window_layers,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids_from_value(d.get("eos_token_id")),
            pad_token_id=d.get("pad_token_id"),
        )


def eos_token_ids_or_none(value: Any) -> tuple[int, ...] | None:
    """`eos_token_id` as written in config.json / generation_config.json; None if absent."""
    if value is None:
        return None
    return eos_ids_from_value(value)


def eos_ids_from_value(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _architecture(d: Mapping[str, Any]) -> str:
    architectures = d.get("architectures") or []
    if not architectures:
        raise ValueError(
            f"config.json has no 'architectures'; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def _rope_from_dict(d: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    # 5.x: everything inside `rope_parameters`; 4.x: `rope_theta` at top level plus an optional
    # `rope_scaling` dict whose type key is `rope_type` (newer) or `type` (older).
    params: dict[str, Any] = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    theta = float(params.get("rope_theta", d.get("rope_theta", _DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type != "llama3":
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    try:
        scaling = RopeScaling(
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            # transformers falls back to max_position_embeddings when the original is missing.
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings")
                or d.get("max_position_embeddings", 0)
            ),
        )
    except KeyError as exc:
        raise ValueError(f"llama3 rope scaling lacks {exc.args[0]!r}") from None
    return theta, scaling


def _sliding_window_from_dict(
    architecture: str, d: Mapping[str, Any], num_layers: int
) -> tuple[int | None, tuple[int, ...]]:
    window = d.get("sliding_window")
    if architecture == "MistralForCausalLM":
        # MistralModel applies the window to every layer whenever it is set.
        return (int(window), tuple(range(num_layers))) if window else (None, ())
    if architecture == "Qwen2ForCausalLM":
        if not d.get("use_sliding_window", False) or not window:
            return None, ()
        layer_types = d.get("layer_types")
        if layer_types is None:
            first = int(d.get("max_window_layers", 28))
            layers = tuple(range(first, num_layers))
        else:
            layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        return (int(window), layers) if layers else (None, ())
    return None, ()
