"""The candidates `attention_choice` times: each attention path run on the model's own shapes
(heads, KV heads, head size, dtype) over a paged pool of random K/V, for a fresh prefill of
`PREFILL_TOKENS` tokens and a decode step of `DECODE_BATCH` sequences of `DECODE_CONTEXT` tokens,
through the same `paged_attention` the model runs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch

from shared.model import attention_choice, paged_decode, paged_prefill
from shared.model.attention import GatherScratch, paged_attention
from shared.model.attention_choice import Choice, Shapes
from shared.model.config import ModelConfig
from shared.model.forward_batch import ForwardBatch, SeqEntry

log = logging.getLogger(__name__)

PREFILL_TOKENS, DECODE_BATCH, DECODE_CONTEXT, BLOCK_SIZE = 1024, 16, 512, 16


def shapes_for(config: ModelConfig, dtype: torch.dtype) -> Shapes:
    return Shapes(
        dtype=str(dtype).removeprefix("torch."),
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        prefill_tokens=min(PREFILL_TOKENS, config.max_context_len),
        decode_batch=DECODE_BATCH,
        decode_context=min(DECODE_CONTEXT, config.max_context_len - 1),
    )


def _entries(shapes: Shapes, kind: str) -> list[SeqEntry]:
    if kind == "prefill":
        tokens = shapes.prefill_tokens
        return [SeqEntry([0] * tokens, 0, list(range(-(-tokens // BLOCK_SIZE))))]
    per_seq = -(-(shapes.decode_context + 1) // BLOCK_SIZE)
    return [
        SeqEntry([0], shapes.decode_context, list(range(i * per_seq, (i + 1) * per_seq)))
        for i in range(shapes.decode_batch)
    ]


def candidates(shapes: Shapes, kind: str) -> dict[str, Callable[[], object]]:
    """Each path that runs `kind` attention here, as a call of `paged_attention` to time."""
    dtype = getattr(torch, shapes.dtype)
    gen = torch.Generator().manual_seed(0)
    entries = _entries(shapes, kind)
    blocks = sum(len(e.block_table) for e in entries)
    kv_heads, head_dim = shapes.num_kv_heads, shapes.head_dim
    pool = torch.randn(2, blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    batch = ForwardBatch.build(entries, BLOCK_SIZE, "cpu", ragged_decode=True)
    rows = batch.num_tokens
    q = torch.randn(rows, shapes.num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype)
    if kind == "prefill":
        native = paged_prefill.usable(q, pool, batch.groups[0])
    else:
        native = dtype in paged_decode.KERNEL_DTYPES and paged_decode.library() is not None
    run = partial(paged_attention, q, k, v, pool, batch, head_dim**-0.5, None, GatherScratch())
    paths = [p for p in attention_choice.PATHS if p != "native" or native]
    return {p: partial(run, None, (p, p)) for p in paths}


def establish(config: ModelConfig, dtype: torch.dtype, device_type: str) -> Choice | None:
    """At a node's start: the attention paths for this model on this CPU, timed or cached (see
    attention_choice.py). Other devices, and latent (MLA) pools, keep their one path."""
    if device_type != "cpu" or config.mla is not None:
        return None
    shapes = shapes_for(config, dtype)
    return attention_choice.establish(shapes, partial(candidates, shapes))
