"""Which prompt blocks a sliding-window layer's KV transfer may leave out.

A layer with window `w` lets the query at position `q` see keys at positions `> q - w`
(shared/model/attention.py). The decode node's first query is the first generated token, at
position `prompt_len`, and every later query sits further right, so a prompt block whose
positions all lie below `prompt_len - w` is never read by that layer on the decode node. Leaving
it out shrinks a long prompt's push of a model like Gemma 3 (five 1024-token window layers to one
global) by most of its window layers' bytes.

The decode node computes the skip from its own model config and sends it to the prefill node in
the `KvDestination` (one count per layer), so both sides use the same numbers. Such blocks hold
stale rows in those layers, so the decode node never offers them for prefix reuse
(`LlmRequest.partial_kv_blocks`); preemption recomputes a request from its tokens, never from
them.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.model.config import ModelConfig


def layer_windows(config: ModelConfig) -> tuple[int | None, ...]:
    """Each layer's attention window (None: global attention)."""
    return tuple(config.window_for_layer(layer) for layer in range(config.num_layers))


def skipped_blocks(
    windows: Sequence[int | None], prompt_len: int, block_size: int, first_block: int
) -> tuple[int, ...]:
    """Per layer, how many of the transfer's blocks (prompt blocks `first_block`, ...) the
    prefill node need not send: those whose every position is below `prompt_len - window`.
    Empty when no layer skips anything (nothing to tell the prefill node)."""
    counts = tuple(
        0 if w is None else max(0, (prompt_len - w) // block_size - first_block) for w in windows
    )
    return counts if any(counts) else ()


def skipped_problem(skipped: Sequence[int], num_layers: int, num_blocks: int) -> str | None:
    """Why a transfer's `skipped` counts are invalid (None when they are fine): one per layer,
    and every layer keeps at least the last block (the one the next query's position needs)."""
    if not skipped:
        return None
    if len(skipped) != num_layers:
        return f"skipped_blocks has {len(skipped)} entries for {num_layers} layers"
    if max(skipped) >= num_blocks:
        return f"skipped_blocks {max(skipped)} leaves none of the {num_blocks} blocks to send"
    return None


def skipped_bytes(skipped: Sequence[int], block_bytes_per_layer: int) -> int:
    """Payload bytes the skip leaves out of one transfer."""
    return sum(skipped) * block_bytes_per_layer
