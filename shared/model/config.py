"""Model hyper-parameters for the decoder-only architectures pdserve serves.

`ModelConfig` is the one description every role (prefill, decode, loader, engine) agrees on. It is
built by hand (the built-in `tiny` model), from a Hugging Face `config.json` by the model's family
(shared/model/registry.py), or from GGUF metadata (shared/model/gguf_loader.py). Its defaults are
Llama's; each field a family changes says which family, so a reader sees every variant here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shared.kv.layout import KvLayout, dtype_name
from shared.model.mla_config import MlaConfig
from shared.model.moe_config import MoeConfig

if TYPE_CHECKING:
    from shared.model.vision.vision_config import VisionConfig

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3", "linear", "yarn")
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh")
# "rms": x / rms(x) cast to the model dtype, times weight (Llama). "rms_unit_offset": the whole
# product x / rms(x) * (1 + weight) in fp32, then cast (Gemma).
SUPPORTED_NORMS: tuple[str, ...] = ("rms", "rms_unit_offset")

# transformers' `RotaryEmbeddingConfigMixin.default_theta`: used when a config names no theta.
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_RMS_NORM_EPS = 1e-6


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `default` (none), `linear` (frequencies / factor), `llama3` or
    `yarn` (DeepSeek-V2/V3; cos and sin times `attention_factor`)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    # yarn: the ramp between extrapolated and interpolated frequencies, and the cos/sin factor
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    # DeepSeek's `mscale_all_dim`: the softmax scale also takes yarn's mscale of it, squared
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}"
            )
        if self.rope_type != "default" and self.factor <= 0:
            raise ValueError(f"{self.rope_type} rope factor must be positive, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "llama3 rope needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )
        if self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"{self.rope_type} rope needs a positive original_max_position_embeddings"
            )


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
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # Bias on q/k/v projections (Qwen2: always; Llama, Qwen3: `attention_bias`).
    attention_bias: bool = False
    # Bias on o_proj: Llama's `attention_bias` covers o_proj too, Qwen2's qkv bias does not.
    attention_out_bias: bool = False
    mlp_bias: bool = False
    # Windowed attention (Mistral, Phi-3: every layer; Qwen2/3: layers >= max_window_layers when
    # enabled; Gemma: the `layer_types` pattern). A layer in `sliding_window_layers` lets
    # position q attend to keys in (q - window, q].
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # The gated MLP's activation: SwiGLU (silu) or Gemma's GELU-tanh gating.
    hidden_act: str = "silu"
    norm: str = "rms"
    # RMSNorm over each q and k head before rope (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Gemma: a norm on the attention output and two around the MLP (pre/post feed-forward).
    sandwich_norms: bool = False
    # Gemma: embeddings times sqrt(hidden_size), the factor rounded to the model dtype.
    scale_embeddings: bool = False
    # Attention scale is query_pre_attn_scalar ** -0.5 (Gemma) instead of head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # cap * tanh(x / cap) on attention scores (Gemma 2) and on the final logits (Gemma 2/3).
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Rope base of the sliding-window layers when it differs from the global one (Gemma 3).
    local_rope_theta: float | None = None
    # Rotated leading dims of each head (Phi-3's partial_rotary_factor); None: all of them.
    rotary_dim: int | None = None
    # Mixture-of-experts MLPs (Mixtral, Qwen3-MoE); None: a dense MLP in every layer.
    moe: MoeConfig | None = None
    # Multi-head latent attention (DeepSeek-V2/V3): head_dim is then the rope dims
    # (qk_rope_head_dim, as transformers sets it) and the pool holds one latent per token.
    mla: MlaConfig | None = None
    # mRoPE (Qwen2-VL, Qwen2.5-VL): how many of each head's rotary frequencies turn with the
    # time, height and width positions; None: one position axis
    mrope_section: tuple[int, ...] | None = None
    # the vision tower and the prompt token its embeddings replace (Qwen2-VL's <|image_pad|>)
    vision: VisionConfig | None = None
    image_token_id: int | None = None

    def __post_init__(self) -> None:
        self._validate()

    # ----------------------------------------------------------------------------- validation

    def _validate(self) -> None:
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
        _check_choice("hidden_act", self.hidden_act, SUPPORTED_ACTIVATIONS)
        _check_choice("norm", self.norm, SUPPORTED_NORMS)
        self._validate_attention_options()
        self._validate_sliding_window()
        self._validate_vision()
        if self.moe is not None:
            self.moe.check_layers(self.num_layers)
        # pad is not checked: some real configs name a pad id outside the vocabulary, harmlessly.
        for token in (self.bos_token_id, *self.eos_token_ids):
            if token is not None and not 0 <= token < self.vocab_size:
                raise ValueError(f"special token id {token} outside vocab [0, {self.vocab_size})")

    def _validate_attention_options(self) -> None:
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {value}")
        if self.local_rope_theta is not None and self.local_rope_theta <= 0:
            raise ValueError(f"local_rope_theta must be positive, got {self.local_rope_theta}")
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ValueError(
                f"rotary_dim must be even and in (0, head_dim={self.head_dim}], "
                f"got {self.rotary_dim}"
            )

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

    def _validate_vision(self) -> None:
        section = self.mrope_section
        if section is not None and (len(section) != 3 or sum(section) != self.rotated_dims // 2):
            raise ValueError(
                f"mrope_section {list(section)} must be 3 runs summing to half the rotated dims "
                f"({self.rotated_dims // 2})"
            )
        if self.vision is None:
            return
        if self.mrope_section is None or self.image_token_id is None:
            raise ValueError("a vision model needs mrope_section and image_token_id")
        if not 0 <= self.image_token_id < self.vocab_size:
            raise ValueError(f"image_token_id {self.image_token_id} outside the vocabulary")
        if self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(
                f"the vision tower outputs {self.vision.out_hidden_size} features, the text "
                f"model takes {self.hidden_size}"
            )

    # ------------------------------------------------------------------------------- queries

    def window_for_layer(self, layer: int) -> int | None:
        """The attention window of `layer`, or None for full causal attention."""
        if self.sliding_window is not None and layer in self.sliding_window_layers:
            return self.sliding_window
        return None

    def local_rope_for_layer(self, layer: int) -> bool:
        """Whether `layer` rotates with the sliding layers' own rope base (Gemma 3)."""
        return self.local_rope_theta is not None and self.window_for_layer(layer) is not None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotated_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def llama_layers(self) -> bool:
        """Whether every layer computes exactly what a Llama layer does (so the native one-call
        decode stack, which implements only that, may run the model)."""
        return (
            self.hidden_act == "silu"
            and self.norm == "rms"
            and not (self.qk_norm or self.sandwich_norms or self.scale_embeddings)
            and self.query_pre_attn_scalar is None
            and self.attn_logit_softcap is None
            and self.final_logit_softcap is None
            and self.local_rope_theta is None
            and self.rotated_dims == self.head_dim
            and self.moe is None
            and self.mla is None
        )

    @property
    def max_context_len(self) -> int:
        return self.max_position_embeddings

    def kv_layout(self, block_size: int, dtype: torch.dtype | str) -> KvLayout:
        name = dtype if isinstance(dtype, str) else dtype_name(dtype)
        planes, heads, dim = self.kv_row_shape
        return KvLayout(
            num_layers=self.num_layers,
            num_kv_heads=heads,
            head_dim=dim,
            block_size=block_size,
            dtype=name,
            planes=planes,
        )

    @property
    def kv_row_shape(self) -> tuple[int, int, int]:
        """(planes, heads, dim) of one token's entry in one layer of the pool."""
        if self.mla is not None:
            return 1, 1, self.mla.latent_dim
        return 2, self.num_kv_heads, self.head_dim


def _check_choice(name: str, value: str, supported: Iterable[str]) -> None:
    if value not in supported:
        raise ValueError(f"unsupported {name} {value!r}; supported: {list(supported)}")


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
