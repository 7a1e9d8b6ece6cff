"""Layer-wise KV push planning: which blocks of which layer go where after each step.

Runs on the engine thread inside the model's layer hook: right after layer i's K/V for the step
are written, the blocks that the step finished are queued to the event loop, which sends them
while layer i+1 computes. On CPU the sender reads them straight from the pool: the blocks are
full (later chunks write only later blocks) and pinned here, so neither preemption nor the end
of the request can hand them to anyone else before the push is over (the request's pins go
when the prefill node releases it, after the sends). On CUDA they are packed (a device copy on
the compute stream, ordered after the layer) and sent from the copy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shared.engine.scheduler import ScheduledRequest
from shared.engine.utils import cdiv
from transfer.protocol import TransferDestination
from transfer.ucx import KvSender


@dataclass
class LayerMessage:
    layer: int
    dest_block_ids: list[int]
    src_block_ids: list[int]
    payload: torch.Tensor | None  # packed copy (CUDA pools); None: send from the pool


FINAL = None  # queued after the last message of a request


@dataclass
class PushState:
    """One request's push; created on the event loop, advanced by the engine thread."""

    request_id: str
    destination: TransferDestination
    first_block_index: int
    layerwise: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[LayerMessage | None] = field(default_factory=asyncio.Queue)
    sent_upto: int = 0  # prompt blocks [0, sent_upto) are queued for every layer
    cancelled: bool = False
    completed: bool = False  # every message sent and the first token known
    first_message_at: float | None = None  # wall clock, for the TTFT breakdown

    def put(self, item: LayerMessage | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def dest_ids(self, start: int, stop: int) -> list[int]:
        offset = self.first_block_index
        return list(self.destination.block_ids[start - offset : stop - offset])


@dataclass
class _Work:
    state: PushState
    src: list[int]
    dst: list[int]
    final: bool
    upto: int
    table: list[int]


def plan_push(
    scheduled: Sequence[ScheduledRequest],
    pushes: dict[str, PushState],
    block_table: Callable[[str], list[int]],
    block_size: int,
) -> list[_Work]:
    work = []
    for s in scheduled:
        state = pushes.get(s.request.request_id)
        if state is None or state.cancelled:
            continue
        r = s.request
        done = r.num_computed_tokens + s.num_new_tokens
        final = s.completes_context
        upto = cdiv(r.prompt_len, block_size) if final else done // block_size
        start = max(state.sent_upto, state.first_block_index)
        if upto <= start and not final:
            continue
        table = block_table(r.request_id)
        src = table[start:upto] if upto > start else []
        dst = state.dest_ids(start, upto) if src else []
        work.append(_Work(state, src, dst, final, upto, table))
    return work


def _message(kv_pool: torch.Tensor, layer: int, dst: list[int], src: list[int]) -> LayerMessage:
    if not kv_pool.is_cuda:
        return LayerMessage(layer, dst, src, None)
    with torch.inference_mode(False):  # the hook runs inside the engine's inference_mode
        return LayerMessage(layer, dst, src, KvSender.pack(kv_pool, layer, src))


def make_layer_hook(
    work: list[_Work],
    kv_pool: torch.Tensor,
    num_layers: int,
    pin: Callable[[str, list[int]], None],
) -> Callable[[int], None] | None:
    """`pin(request_id, blocks)` pins blocks for the request until it is released."""
    if not work:
        return None
    last_layer = num_layers - 1

    def hook(layer: int) -> None:
        for w in work:
            if w.state.layerwise and w.src:
                if layer == 0:
                    pin(w.state.request_id, w.src)
                if w.final or kv_pool.is_cuda:
                    w.state.put(_message(kv_pool, layer, w.dst, w.src))
                elif layer == last_layer:
                    # An earlier chunk's blocks go once all its layers are done, as one message
                    # (queued together, the sender coalesces them): they still move while the
                    # next chunk computes, and every message costs the loop (which shares the
                    # compute's core) ~0.1 ms. The last chunk goes layer by layer: its transfer
                    # is what overlaps the end of the prompt's compute.
                    _queue_all_layers(w.state, kv_pool, num_layers, w.dst, w.src)
            if layer != last_layer:
                continue
            if not w.state.layerwise and w.final:
                _queue_whole_request(w, kv_pool, num_layers, pin)
            w.state.sent_upto = max(w.state.sent_upto, w.upto)
            if w.final:
                w.state.put(FINAL)

    return hook


def _queue_whole_request(
    w: _Work, kv_pool: torch.Tensor, num_layers: int, pin: Callable[[str, list[int]], None]
) -> None:
    """Whole-request mode (the baseline layer-wise is measured against): everything is sent
    after the last layer of the last chunk, one message per layer."""
    start = w.state.first_block_index
    src = w.table[start : w.upto]
    dst = w.state.dest_ids(start, w.upto)
    pin(w.state.request_id, src)
    _queue_all_layers(w.state, kv_pool, num_layers, dst, src)


def _queue_all_layers(
    state: PushState, kv_pool: torch.Tensor, num_layers: int, dst: list[int], src: list[int]
) -> None:
    """One message per layer, queued together (so the sender coalesces them into one)."""
    for layer in range(num_layers):
        state.put(_message(kv_pool, layer, dst, src))
