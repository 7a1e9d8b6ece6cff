"""Batched paged attention over the KV pool (layout in `shared.kv.layout`), per group of a
`ForwardBatch` (shared/model/forward_batch.py).

* A decode or continued-prefill group gathers its sequences' K/V from the pool into a padded
  `[G, Kmax, kv_heads, head_dim]` with one block-level `index_select` per K/V plane, reading
  back this step's tokens after they were written, so a chunk after earlier chunks (or after a
  prefix-cache hit, `num_computed > 0`) sees exactly the keys a single full pass would. A mask
  encodes causality (key position <= query position), which also hides the padding;
  sliding-window layers add `key position > query position - window`.
* A decode group on CPU reads its keys and values where they lie in the pool instead
  (shared/model/paged_decode.py), when this machine could build that kernel; so does a prefill
  group, fresh or continued, in bf16 (and in fp32 where fp32 prefill has left MKL's bits anyway;
  shared/model/paged_prefill.py), writing its rows of the output in place.
* Otherwise a fresh-prefill group (nothing cached) attends over this step's K/V directly with
  SDPA's causal mode, skipping the pool round trip and the masked half of the work.
* Which of the kernel, SDPA and the eager formula runs each kind (prefill, decode) is chosen by
  timing them on this machine (shared/model/attention_choice.py); the kernels decline shapes
  they do not cover, which then take SDPA. Soft-capped layers (Gemma 2) always take the eager
  formula: SDPA has no soft-capping step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shared.model import attention_choice, paged_decode, paged_prefill
from shared.model.attention_groups import AttentionGroup
from shared.model.forward_batch import ForwardBatch


class GatherScratch:
    """Reusable destination for the per-layer K/V gather.

    A fresh multi-megabyte tensor per layer costs page faults comparable to the copy itself
    (the CPU allocator hands large blocks back to the OS on free), so the model keeps one buffer
    that grows to the largest gather seen and reuses it for every layer and step. Not
    thread-safe: one forward at a time per model.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buf
        if (
            buf is None
            or buf.numel() < numel
            or buf.dtype != like.dtype
            or buf.device != like.device
        ):
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buf = buf
        return buf[:numel].view(shape)


PROFILE_RANGE = "pdserve::attention"  # the roofline's time share of attention reads this range


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_pool: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    window: int | None,
    scratch: GatherScratch,
    softcap: float | None = None,
    paths: tuple[str, str] | None = None,
) -> torch.Tensor:
    """Attention of the batch's new tokens over their full context.

    q: [T, heads, head_dim] and k, v: [T, kv_heads, head_dim], this step's tokens (rotated).
    layer_pool: `kv_pool[layer]`, shape (2, num_blocks, block_size, kv_heads, head_dim), with this
    step's K/V already written. `softcap`: scores become cap * tanh(scores / cap) before the mask
    (Gemma 2); neither a kernel nor SDPA has that step, so such layers run torch's eager formula.
    `paths`: (prefill, decode) path, each "native", "sdpa" or "torch" (default: the measured
    choice, shared/model/attention_choice.py). Returns [T, heads * head_dim] in q's dtype.
    """
    if paths is None:
        paths = (attention_choice.path("prefill"), attention_choice.path("decode"))
    args = (q, k, v, layer_pool, batch, scale, window, scratch, softcap, paths)
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(PROFILE_RANGE):
            return _paged_attention(*args)
    return _paged_attention(*args)


def _paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_pool: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    window: int | None,
    scratch: GatherScratch,
    softcap: float | None,
    paths: tuple[str, str],
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    out = None
    for group in batch.groups:
        decode = group.query_len == 1 and not group.fresh
        chosen = paths[1] if decode else paths[0]
        if chosen == "native" and softcap is None and paged_prefill.usable(q, layer_pool, group):
            if out is None:
                out = q.new_empty(num_tokens, num_heads * head_dim)
            if paged_prefill.prefill_attention(q, layer_pool, group, scale, window, out):
                continue  # the kernel wrote the group's rows of `out`
        g_out = None
        if softcap is not None or chosen == "torch":
            g_out = eager_attention(q, k, v, layer_pool, group, scale, window, softcap, scratch)
        elif group.fresh:
            g_out = _fresh_attention(q, k, v, group, scale, window)
        elif chosen == "native" and paged_decode.usable(q, layer_pool, group):
            g_out = paged_decode.decode_attention(q, layer_pool, group, scale, window)
        if g_out is None:
            g_out = _pool_attention(q, layer_pool, group, scale, window, scratch)
        if group.token_rows is None:
            return g_out  # fast path: the single group covers tokens 0..T-1 in order
        if out is None:
            out = q.new_empty(num_tokens, num_heads * head_dim)
        out.index_copy_(0, group.token_rows, g_out)
    assert out is not None
    return out


def _gather_kv(
    layer_pool: torch.Tensor, blocks: torch.Tensor, scratch: GatherScratch
) -> torch.Tensor:
    """[2, len(blocks), block_size, kv_heads, head_dim]: the listed blocks' K and V."""
    kv = scratch.take((2, blocks.numel(), *layer_pool.shape[2:]), layer_pool)
    # dim-0 index_select per plane: the contiguous-slice copy path, parallel across threads.
    torch.index_select(layer_pool[0], 0, blocks, out=kv[0])
    torch.index_select(layer_pool[1], 0, blocks, out=kv[1])
    return kv


def padded_rows(x: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """[G, heads, Qmax, head_dim] view of the group's rows of a [T, heads, head_dim] tensor."""
    rows = x if group.query_rows is None else x.index_select(0, group.query_rows)
    return rows.view(len(group.seq_ids), group.query_len, *x.shape[1:]).transpose(1, 2)


def _pool_attention(
    q: torch.Tensor,
    layer_pool: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    window: int | None,
    scratch: GatherScratch,
) -> torch.Tensor:
    assert group.kv_blocks is not None
    kv_heads, head_dim = layer_pool.shape[-2:]
    kv = _gather_kv(layer_pool, group.kv_blocks, scratch).to(q.dtype)
    kv = kv.view(2, len(group.seq_ids), group.kv_len, kv_heads, head_dim).transpose(2, 3)
    attn = F.scaled_dot_product_attention(
        padded_rows(q, group),
        kv[0],
        kv[1],
        attn_mask=group.mask(window, q.dtype),
        scale=scale,
        enable_gqa=q.shape[1] != kv_heads,
    )
    return valid_rows(attn, group)


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_pool: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    window: int | None,
    softcap: float | None,
    scratch: GatherScratch,
) -> torch.Tensor:
    """transformers' eager attention, with logit soft-capping where `softcap` is set, over this
    step's K/V (fresh groups) or the gathered pool: scores * scale, cap * tanh(/ cap), + mask,
    fp32 softmax."""
    if group.fresh:
        keys, values = padded_rows(k, group), padded_rows(v, group)
    else:
        assert group.kv_blocks is not None
        kv_heads, head_dim = layer_pool.shape[-2:]
        kv = _gather_kv(layer_pool, group.kv_blocks, scratch).to(q.dtype)
        kv = kv.view(2, len(group.seq_ids), group.kv_len, kv_heads, head_dim).transpose(2, 3)
        keys, values = kv[0], kv[1]
    queries = padded_rows(q, group)  # [G, heads, Qmax, D]
    n_seqs, kv_heads, kv_len, head_dim = keys.shape
    groups = queries.shape[1] // kv_heads  # transformers' repeat_kv
    keys = keys[:, :, None].expand(n_seqs, kv_heads, groups, kv_len, head_dim)
    values = values[:, :, None].expand(n_seqs, kv_heads, groups, kv_len, head_dim)
    keys = keys.reshape(n_seqs, kv_heads * groups, kv_len, head_dim)
    values = values.reshape(n_seqs, kv_heads * groups, kv_len, head_dim)
    scores = torch.matmul(queries, keys.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + group.mask(window, q.dtype)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return valid_rows(torch.matmul(probs, values), group)


def _fresh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    # Queries and keys share positions 0..Qmax-1, so SDPA's top-left causal mode is exact for
    # real queries; padded keys sit after every real query and are never attended.
    attn = F.scaled_dot_product_attention(
        padded_rows(q, group),
        padded_rows(k, group),
        padded_rows(v, group),
        attn_mask=None if window is None else group.mask(window, q.dtype),
        is_causal=window is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return valid_rows(attn, group)


def valid_rows(attn: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """[G, heads, Qmax, head_dim] -> [real queries, heads * head_dim], dropping padding."""
    n_seqs, num_heads, q_max, head_dim = attn.shape
    flat = attn.transpose(1, 2).reshape(n_seqs * q_max, num_heads * head_dim)
    return flat if group.query_valid is None else flat.index_select(0, group.query_valid)
