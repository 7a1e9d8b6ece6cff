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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from prefill_node.job import FINAL, PrefillJob
from shared.cdiv import cdiv
from shared.engine.scheduling.scheduler import ScheduledRequest
from transfer.ucx import KvMessage, KvSender


@dataclass
class _Work:
    job: PrefillJob
    src: tuple[int, ...]  # tuples: the sender keeps a chunk's spans while messages name them
    dst: tuple[int, ...]
    final: bool
    upto: int
    table: list[int]
    # the last chunk's layers not queued yet, and their payload bytes: layers are held until
    # they add up to the size the sender measured worth a message (`min_message_bytes`)
    held: list[KvMessage] = field(default_factory=list)
    held_bytes: int = 0


def plan_push(
    scheduled: Sequence[ScheduledRequest],
    jobs: Mapping[str, PrefillJob],
    block_table: Callable[[str], list[int]],
    block_size: int,
) -> list[_Work]:
    work = []
    for s in scheduled:
        job = jobs.get(s.request.request_id)
        if job is None or job.cancelled:
            continue
        r = s.request
        done = r.num_computed_tokens + s.num_new_tokens
        final = s.completes_context
        upto = cdiv(r.prompt_len, block_size) if final else done // block_size
        start = max(job.sent_upto, job.first_block_index)
        if upto <= start and not final:
            continue
        table = block_table(r.request_id)
        src = tuple(table[start:upto]) if upto > start else ()
        dst = tuple(job.dest_ids(start, upto)) if src else ()
        work.append(_Work(job, src, dst, final, upto, table))
    return work


def _message(
    kv_pool: torch.Tensor, layer: int, dst: tuple[int, ...], src: tuple[int, ...]
) -> KvMessage:
    if not kv_pool.is_cuda:
        return KvMessage(layer=layer, blocks=dst, src=src)
    with torch.inference_mode(False):  # the hook runs inside the engine's inference_mode
        return KvMessage(layer=layer, blocks=dst, payload=KvSender.pack(kv_pool, layer, src))


def make_layer_hook(
    work: list[_Work],
    kv_pool: torch.Tensor,
    num_layers: int,
    pin: Callable[[str, Sequence[int]], None],
) -> Callable[[int], None] | None:
    """`pin(request_id, blocks)` pins blocks for the request until it is released."""
    if not work:
        return None
    last_layer = num_layers - 1
    block_bytes = kv_pool[0, :, 0].numel() * kv_pool.element_size()  # one block, one layer

    def hook(layer: int) -> None:
        for w in work:
            if w.job.layerwise and w.src:
                if layer == 0:
                    pin(w.job.request_id, w.src)
                if kv_pool.is_cuda:
                    _queue_layer(w.job, kv_pool, layer, w.upto - len(w.src), w.dst, w.src)
                elif w.final:
                    _hold_layer(w, kv_pool, layer, block_bytes, layer == last_layer)
                elif layer == last_layer:
                    # An earlier chunk's blocks go once all its layers are done, as one message
                    # (queued together, the sender coalesces them): they still move while the
                    # next chunk computes, and every message costs the loop (which shares the
                    # compute's core) ~0.1 ms. The last chunk goes layer by layer: its transfer
                    # is what overlaps the end of the prompt's compute.
                    _queue_all_layers(w.job, kv_pool, num_layers, w.dst, w.src, w.upto)
            if layer != last_layer:
                continue
            if not w.job.layerwise and w.final:
                _queue_whole_request(w, kv_pool, num_layers, pin)
            w.job.sent_upto = max(w.job.sent_upto, w.upto)
            if w.final:
                w.job.put(FINAL)

    return hook


def _hold_layer(w: _Work, kv_pool: torch.Tensor, layer: int, block_bytes: int, last: bool) -> None:
    """The last chunk, layer by layer: queue the layers held so far once their payload reaches
    the sender's measured `min_message_bytes` (or at the last layer), together, so that they go
    as one message. Per-layer payloads that small would otherwise pay the fixed cost of a
    message each (measured: docs/performance.md, "KV push: what a message costs")."""
    message = _layer_message(w.job, kv_pool, layer, w.upto - len(w.src), w.dst, w.src)
    if message is not None:
        w.held.append(message)
        w.held_bytes += len(message.blocks) * block_bytes
    if w.held and (last or w.held_bytes >= w.job.min_message_bytes):
        w.job.put_many(w.held)
        w.held, w.held_bytes = [], 0


def _queue_whole_request(
    w: _Work, kv_pool: torch.Tensor, num_layers: int, pin: Callable[[str, Sequence[int]], None]
) -> None:
    """Whole-request mode (the baseline layer-wise is measured against): everything is sent
    after the last layer of the last chunk, one message per layer."""
    start = w.job.first_block_index
    src = tuple(w.table[start : w.upto])
    dst = tuple(w.job.dest_ids(start, w.upto))
    pin(w.job.request_id, src)
    _queue_all_layers(w.job, kv_pool, num_layers, dst, src, w.upto)


def _queue_all_layers(
    job: PrefillJob,
    kv_pool: torch.Tensor,
    num_layers: int,
    dst: tuple[int, ...],
    src: tuple[int, ...],
    upto: int,
) -> None:
    """One message per layer, queued together (so the sender coalesces the layers sending the
    same blocks into one); `src` are prompt blocks [upto - len(src), upto)."""
    start = upto - len(src)
    messages = (_layer_message(job, kv_pool, i, start, dst, src) for i in range(num_layers))
    job.put_many([m for m in messages if m is not None])


def _queue_layer(
    job: PrefillJob,
    kv_pool: torch.Tensor,
    layer: int,
    start: int,
    dst: tuple[int, ...],
    src: tuple[int, ...],
) -> None:
    message = _layer_message(job, kv_pool, layer, start, dst, src)
    if message is not None:
        job.put(message)


def _layer_message(
    job: PrefillJob,
    kv_pool: torch.Tensor,
    layer: int,
    start: int,
    dst: tuple[int, ...],
    src: tuple[int, ...],
) -> KvMessage | None:
    """`layer`'s message for prompt blocks `start`, ... (`src` here, `dst` there), less those
    out of its window (None: none left)."""
    cut = max(0, job.sends_from(layer) - start)
    if cut >= len(src):
        return None
    return _message(kv_pool, layer, dst[cut:], src[cut:])
