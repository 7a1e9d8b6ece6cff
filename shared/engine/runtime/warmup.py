"""Start-up warm-up: the forward shapes a node runs first, run once before it reports ready.

Why: a node's first forward pays one-off costs that later ones do not: oneDNN primitive and
weight-reorder caches, the allocator's first large activation buffers, attention's scratch
buffers. Those buffers are fresh memory, and on a VM whose host backs guest memory lazily every
first touch of it faults through the hypervisor: with 2 GiB KV pools on both nodes of this
project's 2-core VM, the first 256-token request took 4.6-5.0 s to its first token against
0.07 s for the second (the prefill node's compute ran at ~120 ms a layer instead of 3 ms, and its
UCX worker was created on the event loop inside that request). A node is ready when its first
user request runs at steady-state speed, as vLLM's and TensorRT-LLM's warm-up runs make theirs.

The forwards write K/V into blocks that nothing holds (the block manager is untouched and every
block is free at start-up); a block's slots are always written by its next owner before they
are read, so what the warm-up leaves there is never seen.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from shared.cdiv import cdiv
from shared.engine.roles.role import EngineParts
from shared.model.forward_batch import ForwardBatch, SeqEntry

log = logging.getLogger(__name__)

WARMUP_DECODE_BATCH = 8  # decode rows of the warm-up step (capped by max_batch_size)
# prefill tokens at most: a longer first prompt still pays first touches for its larger
# buffers, but they are a small share of its compute; an 8k-token fp32 warm-up of SmolLM2
# (a prefill node's whole-prompt budget) would add ~20 s to every start
WARMUP_MAX_TOKENS = 512
_WARMUP_TOKEN = 0  # any id below the vocabulary size


@dataclass(frozen=True)
class WarmupShape:
    prefill_tokens: int  # one sequence, one chunk: the largest step the budget allows
    decode_batch: int  # rows of one decode step over that context


def warmup_shape(parts: EngineParts, max_model_len: int) -> WarmupShape:
    """The engine's largest prefill chunk up to WARMUP_MAX_TOKENS, bounded by the context and
    the pool."""
    config = parts.config
    capacity = parts.kv_manager.get_max_resource_count() * config.block_size
    tokens = min(config.max_num_tokens, WARMUP_MAX_TOKENS, max_model_len, capacity)
    return WarmupShape(tokens, min(WARMUP_DECODE_BATCH, config.max_batch_size))


def warm_up(parts: EngineParts, max_model_len: int) -> WarmupShape:
    """Run one prefill chunk and one decode step (engine thread, before the first request).
    Raises RuntimeError if the engine already holds requests or blocks."""
    kv = parts.kv_manager
    if len(parts.requests) or kv.num_free_blocks != kv.get_max_resource_count():
        raise RuntimeError("warm_up runs on an idle engine only, before the first request")
    shape = warmup_shape(parts, max_model_len)
    block_size = parts.config.block_size
    runner = parts.runner
    table = list(range(cdiv(shape.prefill_tokens, block_size)))
    prefill = SeqEntry([_WARMUP_TOKEN] * shape.prefill_tokens, 0, table)
    # one new token each at the chunk's last position (its slot rewritten by every row)
    decode = [SeqEntry([_WARMUP_TOKEN], shape.prefill_tokens - 1, table)] * shape.decode_batch
    started = time.perf_counter()
    with torch.inference_mode():
        for entries in ([prefill], decode):
            batch = ForwardBatch.build(entries, block_size, runner.device)
            runner.model.forward(batch, runner.kv_pool)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    log.info(
        "warm-up: a %d-token prefill and a %d-row decode step in %.2f s",
        shape.prefill_tokens,
        shape.decode_batch,
        time.perf_counter() - started,
    )
    return shape
