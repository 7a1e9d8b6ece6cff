"""Multi-head latent attention (DeepSeek-V2/V3), over a paged pool of latents.

As transformers' DeepseekV3Attention: q from one projection or through a LoRA (q_a_proj,
q_a_layernorm, q_b_proj); `kv_a_proj_with_mqa` gives each token a latent (normed by
`kv_a_layernorm`) and one rope key shared by all heads; `kv_b_proj` expands the latent into
per-head keys (nope part) and values. The pool keeps only latent + rotated rope key per token
(shared/kv/layout.py's latent layout).

* Prefill (fresh or continued) expands the latents of its context into per-head K/V and runs
  SDPA, as transformers does.
* Decode attends in latent space, the up-projection absorbed (as vLLM and SGLang do): the query's
  nope part times W_UK becomes a latent-space query, scores are taken against the stored rows
  directly, and the attended latent times W_UV gives each head's value. Per step that reads
  kv_lora_rank + rope values per token instead of expanding heads x (nope + v) of them.

No kernel reads this layout: the paged decode / prefill kernels serve K/V pools only, and this
module is torch throughout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.attention import padded_rows, valid_rows
from shared.model.attention_groups import AttentionGroup
from shared.model.config import ModelConfig
from shared.model.gemm import PackedGemm
from shared.model.linear import Linear, register_fused_linear
from shared.model.mla_config import MlaConfig
from shared.model.norms import RMSNorm
from shared.model.rotary import apply_interleaved_rotary, apply_rotary
from shared.model.step_context import StepContext

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, whatever
# the config's rms_norm_eps
LORA_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        m = latent_config(config)
        self.layer, self.mla, self.num_heads = layer, m, config.num_heads
        h, heads, bias = config.hidden_size, config.num_heads, config.attention_bias
        q_out = heads * m.qk_head_dim
        # one GEMM for both projections of x: q (or its LoRA's down-projection) and the latent;
        # not where only the latent's has a bias (transformers' q_proj never has one)
        q_first = "q_proj" if m.q_lora_rank is None else "q_a_proj"
        parts = {
            q_first: q_out if m.q_lora_rank is None else m.q_lora_rank,
            "kv_a_proj_with_mqa": m.latent_dim,
        }
        self.fused_x_proj = not (m.q_lora_rank is None and bias)
        if self.fused_x_proj:
            register_fused_linear(self, "x_proj", h, parts, bias, device, dtype)
            self.x_proj_gemm: PackedGemm
        else:
            self.q_proj = Linear.empty(h, q_out, False, device, dtype)
            self.kv_a_proj_with_mqa = Linear.empty(h, m.latent_dim, bias, device, dtype)
        if m.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS, device, dtype)
            self.q_b_proj = Linear.empty(m.q_lora_rank, q_out, False, device, dtype)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS, device, dtype)
        kv_b_out = heads * (m.qk_nope_head_dim + m.v_head_dim)
        self.kv_b_proj = Linear.empty(m.kv_lora_rank, kv_b_out, False, device, dtype)
        self.o_proj = Linear.empty(heads * m.v_head_dim, h, bias, device, dtype)
        # decode in latent space; False expands the pool's latents as prefill does (tests
        # compare the two)
        self.absorb = True

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        m, tokens = self.mla, x.shape[0]
        if self.fused_x_proj:
            projected = self.x_proj_gemm(x)
            q, compressed = projected.split([projected.shape[1] - m.latent_dim, m.latent_dim], -1)
        else:
            q, compressed = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        if m.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(tokens, self.num_heads, m.qk_head_dim)
        latent, k_rope = compressed.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope = self._rotate(q[..., m.qk_nope_head_dim :], step)  # [T, heads, rope]
        k_rope = self._rotate(k_rope[:, None], step)[:, 0]  # [T, rope], shared by the heads
        rows = torch.cat((latent, k_rope), dim=-1)  # [T, latent + rope]: what the pool keeps
        layer_pool = step.kv_pool[self.layer]  # (1, blocks, block_size, 1, latent + rope)
        slots = step.batch.slot_mapping
        layer_pool.view(-1, m.latent_dim).index_copy_(0, slots, rows.to(layer_pool.dtype))
        if step.layer_hook is not None:
            step.layer_hook(self.layer)  # this layer's latents for the batch are final from here
        q = torch.cat((q[..., : m.qk_nope_head_dim], q_rope), dim=-1)
        out = None
        for group in step.batch.groups:
            if group.query_len == 1 and not group.fresh and self.absorb:
                g_out = self._latent_decode(q, layer_pool, group)
            else:
                g_out = self._expanded(q, rows, layer_pool, group)
            if group.token_rows is None:
                out = g_out  # the single group covers tokens 0..T-1 in order
                break
            if out is None:
                out = q.new_empty(tokens, self.num_heads * m.v_head_dim)
            out.index_copy_(0, group.token_rows, g_out)
        assert out is not None
        return self.o_proj(out)

    def _rotate(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        if self.mla.rope_pairing == "interleave":
            return apply_interleaved_rotary(x, *step.rope)
        return apply_rotary(x, *step.rope)

    def _context(
        self, rows: torch.Tensor, layer_pool: torch.Tensor, group: AttentionGroup
    ) -> torch.Tensor:
        """[G, Kmax, latent + rope]: this step's rows (fresh groups) or the pool's."""
        if group.fresh:
            return padded_rows(rows[:, None], group)[:, 0]
        assert group.kv_blocks is not None
        blocks = layer_pool[0].index_select(0, group.kv_blocks)  # [n, block_size, 1, D]
        return blocks.view(len(group.seq_ids), group.kv_len, -1).to(rows.dtype)

    def _expanded(
        self, q: torch.Tensor, rows: torch.Tensor, layer_pool: torch.Tensor, group: AttentionGroup
    ) -> torch.Tensor:
        """transformers' computation: the context's latents up-projected into per-head keys and
        values, SDPA over them. q: [T, heads, qk_head_dim]; returns [real queries, heads * v]."""
        m, heads = self.mla, self.num_heads
        context = self._context(rows, layer_pool, group)
        n_seqs, kv_len = context.shape[:2]
        latent, k_rope = context.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(n_seqs, kv_len, heads, -1).transpose(1, 2)
        k_nope, values = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_rope = k_rope[:, None].expand(n_seqs, heads, kv_len, m.qk_rope_head_dim)
        keys = torch.cat((k_nope, k_rope), dim=-1)  # [G, heads, Kmax, qk_head_dim]
        attn = F.scaled_dot_product_attention(
            padded_rows(q, group),
            keys,
            values,
            attn_mask=None if group.fresh else group.mask(None, q.dtype),
            is_causal=group.fresh,  # fresh: queries and keys share positions 0..Qmax-1
            scale=m.softmax_scale,
        )
        return valid_rows(attn, group)

    def _latent_decode(
        self, q: torch.Tensor, layer_pool: torch.Tensor, group: AttentionGroup
    ) -> torch.Tensor:
        """Single queries attending in latent space; returns [G, heads * v]."""
        m, heads = self.mla, self.num_heads
        q = q if group.query_rows is None else q.index_select(0, group.query_rows)
        context = self._context(q, layer_pool, group)  # [G, Kmax, latent + rope]
        w_kv = self.kv_b_proj.weight.view(heads, -1, m.kv_lora_rank)
        w_uk, w_uv = w_kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        # [heads, G, nope] @ [heads, nope, latent]: each head's query in latent space
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        queries = torch.cat((q_latent, q_rope), dim=-1)  # [G, heads, latent + rope]
        scores = torch.matmul(queries, context.transpose(1, 2)) * m.softmax_scale
        scores = scores + group.mask(None, q.dtype)[:, 0]  # [G, 1, Kmax] masks padding
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        attended = torch.matmul(probs, context[..., : m.kv_lora_rank])  # [G, heads, latent]
        # [heads, G, latent] @ [heads, latent, v]: each head's value from its attended latent
        out = torch.bmm(attended.transpose(0, 1), w_uv.transpose(1, 2))
        return out.transpose(0, 1).reshape(q.shape[0], heads * m.v_head_dim)


def latent_config(config: ModelConfig) -> MlaConfig:
    """`config.mla`, which a latent-attention model must have."""
    if config.mla is None:
        raise ValueError("latent attention needs ModelConfig.mla")
    return config.mla
