"""Decoder-only transformer (Llama / Qwen2 / Mistral) with paged attention over the KV pool.

Numerics follow transformers' modeling_llama / modeling_qwen2 / modeling_mistral: RMSNorm computes
its variance in fp32 and casts back before the weight multiply, RoPE uses fp32 `inv_freq` and
`rotate_half`, llama3 frequency scaling mirrors `_compute_llama3_parameters`, the MLP is SwiGLU.
Parameter names equal the Hugging Face state-dict keys (`model.layers.0.self_attn.q_proj.weight`,
...), so a checkpoint loads with a plain name-for-name copy.

Parameters are created uninitialised (`torch.empty`): the loader either copies checkpoint tensors
in or fills dummy weights, so construction costs only the allocation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shared.model import fused_ops
from shared.model.attention import GatherScratch, paged_attention
from shared.model.config import ModelConfig, RopeScaling
from shared.model.decode_stack import DecodeStack
from shared.model.forward_batch import ForwardBatch
from shared.model.gemm import PackedGemm

LayerHook = Callable[[int], None]


@dataclass
class StepContext:
    """What every layer needs for one forward pass besides its input."""

    batch: ForwardBatch
    kv_pool: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, head_dim]
    layer_hook: LayerHook | None
    scratch: GatherScratch


def _param(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """A projection whose parameters may be slices of a larger fused weight.

    No default initialisation: the loader overwrites every parameter anyway.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        # nn.Parameter aliases the given storage, so loading into a slice fills the fused tensor.
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.gemm = PackedGemm(self.weight, self.bias)

    @classmethod
    def empty(
        cls,
        in_features: int,
        out_features: int,
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> Linear:
        weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
        return cls(weight, torch.empty(out_features, device=device, dtype=dtype) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x)


def register_fused_linear(
    owner: nn.Module,
    fused_name: str,
    in_features: int,
    parts: dict[str, int],
    bias: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Give `owner` one `Linear` child per part whose weights are row slices of one fused tensor.

    The parts keep their Hugging Face names (checkpoints load name for name) while the forward
    pass runs one GEMM over buffer `{fused_name}_weight` (and `_bias`) instead of three (q/k/v) or
    two (gate/up): a decode step is dominated by per-op overhead, not FLOPs.
    """
    total = sum(parts.values())
    weight = torch.empty(total, in_features, device=device, dtype=dtype)
    fused_bias = torch.empty(total, device=device, dtype=dtype) if bias else None
    owner.register_buffer(f"{fused_name}_weight", weight, persistent=False)
    owner.register_buffer(f"{fused_name}_bias", fused_bias, persistent=False)
    setattr(owner, f"{fused_name}_gemm", PackedGemm(weight, fused_bias))
    start = 0
    for name, rows in parts.items():
        part_bias = None if fused_bias is None else fused_bias[start : start + rows]
        owner.add_module(name, Linear(weight[start : start + rows], part_bias))
        start += rows


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(num, dim, device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(dim, device=device, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as LlamaRMSNorm so bf16 results match transformers bit for bit.
        # In-place where a fresh tensor is at hand: the same values, fewer allocations.
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(self.eps))
        return (x32 * inv_rms).to(input_dtype).mul_(self.weight)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """x += delta in place (when given), then this norm of x: one pass in bf16 on CPU."""
        if x.dim() == 2 and self.weight.dtype == x.dtype and fused_ops.usable(x):
            return fused_ops.add_rms_norm(x, delta, self.weight, self.eps)
        if delta is not None:
            x.add_(delta)
        return self(x)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """fp32 inverse frequencies, as transformers computes them (on CPU)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq


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
    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and *signed* sin of shape [T, 1, head_dim] (broadcast over heads) in `dtype`:
        the sin's first half is negated, as `rotate_half` negates the half it moves there."""
        freqs = positions[:, None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : sin.shape[-1] // 2].neg_()
        return emb.cos().to(dtype)[:, None], sin.to(dtype)[:, None]


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


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        c = config
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.window = c.window_for_layer(layer)
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        parts = {"q_proj": q_out, "k_proj": kv_out, "v_proj": kv_out}
        register_fused_linear(self, "qkv", c.hidden_size, parts, c.attention_bias, device, dtype)
        self.qkv_gemm: PackedGemm
        self.o_proj = Linear.empty(q_out, c.hidden_size, c.attention_out_bias, device, dtype)

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_gemm(x)
        heads = qkv.view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        v = heads[:, self.num_heads + self.num_kv_heads :]
        layer_pool = step.kv_pool[self.layer]
        if layer_pool.dtype == qkv.dtype == step.rope[0].dtype and fused_ops.usable(qkv):
            qk = fused_ops.rope_store(
                qkv, self.num_heads, step.rope, layer_pool, step.batch.slot_mapping
            )
        else:
            # q and k heads are adjacent in the fused output: rotate them with one set of ops.
            qk = apply_rotary(heads[:, : self.num_heads + self.num_kv_heads], *step.rope)
            write_kv(layer_pool, step.batch.slot_mapping, qk[:, self.num_heads :], v)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if step.layer_hook is not None:
            step.layer_hook(self.layer)  # this layer's K/V for the batch are final from here on
        attn = paged_attention(
            q, k, v, layer_pool, step.batch, self.scale, self.window, step.scratch
        )
        return self.o_proj(attn)


def write_kv(
    layer_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store new tokens' K/V at their flat slots of one layer's (2, blocks, block, heads, dim)."""
    kv_heads, head_dim = layer_pool.shape[-2:]
    planes = layer_pool.view(2, -1, kv_heads, head_dim)
    planes[0].index_copy_(0, slots, k.to(layer_pool.dtype))
    planes[1].index_copy_(0, slots, v.to(layer_pool.dtype))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.intermediate_size = i
        parts = {"gate_proj": i, "up_proj": i}
        register_fused_linear(self, "gate_up", h, parts, bias, device, dtype)
        self.gate_up_gemm: PackedGemm
        self.down_proj = Linear.empty(i, h, bias, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_gemm(x)
        if fused_ops.usable(gate_up):
            return self.down_proj(fused_ops.silu_mul(gate_up, self.intermediate_size))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Attention(config, layer, device, dtype)
        self.mlp = MLP(config, device, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, device, dtype)

    def forward(
        self, x: torch.Tensor, pending: torch.Tensor | None, step: StepContext
    ) -> torch.Tensor:
        """Add the previous layer's output `pending` (None at the first layer) to the residual
        stream x in place, run this layer, and return its MLP output: the next layer's pending.
        Each residual add is deferred to the norm that follows it, with which it fuses."""
        h = self.input_layernorm.add_forward(x, pending)
        h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, step))
        return self.mlp(h)


class DecoderStack(nn.Module):
    """The `model.` prefix of the Hugging Face state dict."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, device, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, device, dtype) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.rotary_emb = RotaryEmbedding(config, device)


class Model(nn.Module):
    """LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM over a paged KV pool."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.model = DecoderStack(config, device, dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear.empty(config.hidden_size, config.vocab_size, False, device, dtype)
        self._head = PackedGemm(self.lm_head_weight(), None)
        self._scratch = GatherScratch()
        self._stack = DecodeStack(self.model.layers)
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def lm_head_weight(self) -> torch.Tensor:
        if self.lm_head is None:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self,
        batch: ForwardBatch,
        kv_pool: torch.Tensor,
        *,
        all_logits: bool = False,
        layer_hook: LayerHook | None = None,
        scratch: GatherScratch | None = None,
    ) -> torch.Tensor:
        """Compute the batch's new tokens, writing their K/V into `kv_pool`.

        Returns fp32 logits: `[num_seqs, vocab]` for each sequence's last new token, or
        `[num_tokens, vocab]` for every new token with `all_logits`. `layer_hook(i)` runs right
        after layer i has written this batch's K/V into `kv_pool[i]`, before layer i's attention.
        On CUDA the write is only *enqueued* on the current stream at that point: a hook that
        reads the pool from another stream or over the network must order itself after it
        (e.g. record an event on the current stream). `scratch` replaces the model's own K/V
        gather buffer (a CUDA graph must own the memory its kernels write).
        """
        self._check_pool(kv_pool)
        with torch.inference_mode():
            x = self.model.embed_tokens(batch.input_ids)
            rope = self.model.rotary_emb(batch.positions, x.dtype)
            if layer_hook is None and self._stack.usable(batch, x, kv_pool):
                pending = self._stack.run(x, batch, rope, kv_pool)
            else:
                step = StepContext(batch, kv_pool, rope, layer_hook, scratch or self._scratch)
                pending = None
                for layer in self.model.layers:
                    pending = layer(x, pending, step)
            if not all_logits:
                last = batch.last_token_index
                x = x.index_select(0, last)
                pending = None if pending is None else pending.index_select(0, last)
            return self._head(self.model.norm.add_forward(x, pending)).float()

    def _check_pool(self, kv_pool: torch.Tensor) -> None:
        c = self.config
        shape = tuple(kv_pool.shape)
        expected = (c.num_layers, 2, c.num_kv_heads, c.head_dim)
        if len(shape) != 6 or (*shape[:2], *shape[4:]) != expected:
            raise ValueError(
                f"kv_pool shape {shape} does not match the model: expected "
                f"(layers={c.num_layers}, 2, blocks, block_size, kv_heads={c.num_kv_heads}, "
                f"head_dim={c.head_dim})"
            )
        if kv_pool.device != self.device:
            raise ValueError(f"kv_pool is on {kv_pool.device}, model on {self.device}")
