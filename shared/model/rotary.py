"""Rotary position embedding: inverse frequencies (default, linear, llama3 and yarn scaling), the
cos / signed-sin tables, and their application to all of a head or its leading dims (partial
rotary, Phi-3's `partial_rotary_factor`), or to interleaved pairs (DeepSeek-V2/V3).

Numerics follow transformers: fp32 `inv_freq` computed on CPU, cos/sin cast to the model dtype,
`rotate_half` over the rotated dims.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shared.model.config import ModelConfig, RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """fp32 inverse frequencies, as transformers computes them (on CPU). `head_dim`: the number
    of rotated dims."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif scaling.rope_type == "linear":
        inv_freq /= scaling.factor
    elif scaling.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(head_dim, theta, scaling)
    return inv_freq


def _yarn_inv_freq(dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    # Transcribes transformers' `_compute_yarn_parameters`: frequencies that turn more than
    # `beta_fast` times over the original context are kept, those turning fewer than `beta_slow`
    # times divided by `factor`, a linear ramp in between.
    def correction_dim(rotations: float) -> float:
        old_len = s.original_max_position_embeddings
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's Eq. 21, `0.1 * mscale * log(scale) + 1` (1 for scale <= 1), as transformers."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Transcribes transformers' `_compute_llama3_parameters`: long wavelengths are divided by
    # `factor`, short ones kept, the band in between interpolated smoothly.
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos / signed-sin tables for one rope base. `theta` overrides the config's global base
    (Gemma 3's sliding layers rotate with their own, unscaled)."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        theta: float | None = None,
    ) -> None:
        super().__init__()
        if theta is None:
            inv_freq = rope_inv_freq(config.rotated_dims, config.rope_theta, config.rope_scaling)
        else:
            inv_freq = rope_inv_freq(config.rotated_dims, theta, RopeScaling())
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        # yarn scales cos and sin (in fp32, before the cast); 1.0 elsewhere, where no multiply runs
        self.attention_factor = 1.0 if theta is not None else config.rope_scaling.attention_factor
        # mRoPE (Qwen2-VL): frequency j turns with the position on axis `axis_of_freq[j]` (time,
        # height, width in `mrope_section` runs); None for one-axis models
        self.axis_of_freq: torch.Tensor | None = None
        if config.mrope_section is not None:
            axes = [i % 3 for i, n in enumerate(config.mrope_section) for _ in range(n)]
            self.axis_of_freq = torch.tensor(axes, dtype=torch.long, device=device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and *signed* sin of shape [T, 1, rotated dims] (broadcast over heads) in `dtype`:
        the sin's first half is negated, as `rotate_half` negates the half it moves there.
        `positions`: [T], or [3, T] (time, height, width) for an mRoPE model, where frequency j
        takes its axis's position: the same products transformers computes per axis before it
        picks each frequency's axis, so the same bits."""
        if positions.dim() == 2:
            assert self.axis_of_freq is not None, "3-axis positions for a one-axis rope"
            picked = positions.index_select(0, self.axis_of_freq)  # [rotated / 2, T]
            freqs = picked.t().float() * self.inv_freq.float()
        else:
            freqs = positions[:, None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        sin[:, : sin.shape[-1] // 2].neg_()
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, without materialising rotate_half(x): each half of the
    output adds the other half of x times the signed sin, in place. Bit-identical to the
    transformers formula (negation is exact and commutes with rounding; each product is rounded
    before the add, as there: `addcmul_` would fuse them and change fp32 bits), about 1.4x
    faster (one full-size temporary instead of four)."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half] += x[..., half:] * signed_sin[..., :half]
    out[..., half:] += x[..., :half] * signed_sin[..., half:]
    return out


def apply_partial_rotary(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """`apply_rotary` on the leading cos.shape[-1] dims of each head; the rest pass through."""
    dims = cos.shape[-1]
    if dims == x.shape[-1]:
        return apply_rotary(x, cos, signed_sin)
    return torch.cat((apply_rotary(x[..., :dims], cos, signed_sin), x[..., dims:]), dim=-1)


def apply_interleaved_rotary(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """Rotate x's pairs (x0, x1), (x2, x3), ... each by one frequency, returning the rotated
    evens then the rotated odds: transformers' `apply_rotary_pos_emb_interleave` (DeepSeek-V3).
    DeepSeek-V2's complex rotation yields the same values interleaved; queries and keys both
    rotate here, so their dot products are the same sums. cos / signed_sin: this module's tables
    (both halves hold the same angles; the second half of the signed sin is +sin)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], signed_sin[..., half:]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
