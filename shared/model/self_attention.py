"""The attention block of a decoder layer: fused q/k/v projection, optional per-head q/k norm,
rope, the store of this step's K/V into the paged pool, paged attention and the output
projection.

What a family changes is read from `ModelConfig` once, here: the scale (head_dim or Gemma's
`query_pre_attn_scalar`), this layer's window and rope table, score soft-capping, q/k norm
(Qwen3, Gemma 3) and partial rotary (Phi-3). The fused rope + KV-store kernel covers the plain
case (whole-head rope, no q/k norm); anything else takes torch's formulas, which are
transformers' own.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model import fused_ops
from shared.model.attention import paged_attention
from shared.model.config import ModelConfig
from shared.model.gemm import PackedGemm
from shared.model.linear import Linear, register_fused_linear
from shared.model.norms import make_norm
from shared.model.rotary import apply_partial_rotary
from shared.model.step_context import Rope, StepContext


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        c = config
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.attention_scale
        self.window = c.window_for_layer(layer)
        self.softcap = c.attn_logit_softcap
        self.local_rope = c.local_rope_for_layer(layer)
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        parts = {"q_proj": q_out, "k_proj": kv_out, "v_proj": kv_out}
        register_fused_linear(self, "qkv", c.hidden_size, parts, c.attention_bias, device, dtype)
        self.qkv_gemm: PackedGemm
        self.o_proj = Linear.empty(q_out, c.hidden_size, c.attention_out_bias, device, dtype)
        if c.qk_norm:
            self.q_norm = make_norm(c.norm, c.head_dim, c.rms_norm_eps, device, dtype)
            self.k_norm = make_norm(c.norm, c.head_dim, c.rms_norm_eps, device, dtype)
        self.qk_norm = c.qk_norm
        self.fused_rope = not c.qk_norm and c.rotated_dims == c.head_dim

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_gemm(x)
        if step.lora is not None:
            qkv = step.lora.add(self.layer, "qkv", x, qkv)
        heads = qkv.view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        v = heads[:, self.num_heads + self.num_kv_heads :]
        layer_pool = step.kv_pool[self.layer]
        rope = self._rope(step)
        if (
            self.fused_rope
            and layer_pool.dtype == qkv.dtype == rope[0].dtype
            and fused_ops.usable(qkv)
        ):
            qk = fused_ops.rope_store(
                qkv, self.num_heads, rope, layer_pool, step.batch.slot_mapping
            )
        else:
            # q and k heads are adjacent in the fused output: rotate them with one set of ops.
            qk = self._normed_qk(heads[:, : self.num_heads + self.num_kv_heads])
            qk = apply_partial_rotary(qk, *rope)
            write_kv(layer_pool, step.batch.slot_mapping, qk[:, self.num_heads :], v)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if step.layer_hook is not None:
            step.layer_hook(self.layer)  # this layer's K/V for the batch are final from here on
        attn = paged_attention(
            q, k, v, layer_pool, step.batch, self.scale, self.window, step.scratch, self.softcap
        )
        out = self.o_proj(attn)
        return out if step.lora is None else step.lora.add(self.layer, "o", attn, out)

    def _rope(self, step: StepContext) -> Rope:
        if self.local_rope:
            assert step.local_rope is not None
            return step.local_rope
        return step.rope

    def _normed_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """[T, heads + kv_heads, D] with each q and k head normed (Qwen3, Gemma 3), before rope."""
        if not self.qk_norm:
            return qk
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)


def write_kv(
    layer_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store new tokens' K/V at their flat slots of one layer's (2, blocks, block, heads, dim)."""
    kv_heads, head_dim = layer_pool.shape[-2:]
    planes = layer_pool.view(2, -1, kv_heads, head_dim)
    planes[0].index_copy_(0, slots, k.to(layer_pool.dtype))
    planes[1].index_copy_(0, slots, v.to(layer_pool.dtype))
