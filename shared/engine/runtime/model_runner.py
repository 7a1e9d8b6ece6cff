"""The model side of one engine: the model, the paged KV pool it reads and writes, and the
CUDA-graph runner for decode steps. It turns a step's scheduled requests into logits; it holds
no request state (the scheduler and the KV manager own that).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch

from shared.engine.config import EngineConfig
from shared.engine.requests.multimodal import PromptImage
from shared.engine.requests.request import LlmRequest
from shared.engine.resources.mrope_deltas import MropeDeltaPool
from shared.engine.sampling.prompt_logprobs import fill_prompt_logprobs
from shared.engine.scheduling.scheduler import ScheduledRequest
from shared.kv.layout import KvLayout
from shared.kv.pool import allocate_kv_pool
from shared.model import paged_decode
from shared.model.cuda_graph_padding import DecodeRow
from shared.model.cuda_graph_runner import DecodeGraphRunner, engine_decode_runner
from shared.model.forward_batch import ForwardBatch, SeqEntry
from shared.model.loader import LoadedModel
from shared.model.lora_batch import lora_batch
from shared.model.lora_install import install_lora
from shared.model.step_context import LayerHook
from shared.model.vision.embedding_cache import EmbeddingCache
from shared.model.vision.image_encoder import run_tower


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        layout: KvLayout,
        num_blocks: int,
        device: torch.device,
        *,
        cuda_graphs: bool,
        max_model_len: int,
        dummy_slot_row: int,
        mrope_deltas: MropeDeltaPool | None = None,
    ):
        self.loaded = loaded
        self.model = loaded.model
        if config.lora_slots and self.model.lora is None:
            install_lora(
                self.model, dict(config.lora_modules), config.lora_slots, config.max_lora_rank
            )
        self.device = device
        self.block_size = config.block_size
        # mRoPE models read each seated request's delta (seat-indexed) for its rope positions;
        # vision models encode a prompt's images into the encoder cache as its chunks need them
        self.mrope_deltas = mrope_deltas if loaded.config.mrope_section is not None else None
        self.encoder = None if loaded.config.vision is None else EmbeddingCache(self._encode)
        # decode rows as one attention group where the paged decode kernel runs them (K/V
        # pools only: a latent pool's rows would be padded to the longest context)
        self.ragged = layout.planes == 2 and paged_decode.reads_ragged(device, layout.torch_dtype)
        # CUDA graphs pad decode batches with dummy rows whose K/V land in one scratch block
        # past the BlockManager's blocks (never allocated, never counted); CPU runs eagerly
        self.kv_pool = allocate_kv_pool(layout, num_blocks + int(cuda_graphs), device)
        self.decode_runner: DecodeGraphRunner | None = None
        if cuda_graphs:
            self.decode_runner = engine_decode_runner(
                self.model,
                self.kv_pool,
                max_batch_size=config.max_batch_size,
                max_model_len=max_model_len,
                block_size=config.block_size,
                dummy_slot_row=dummy_slot_row,
                scratch_block=num_blocks,
            )

    def forward(
        self,
        scheduled: Sequence[ScheduledRequest],
        block_table: Callable[[str], list[int]],
        hook: LayerHook | None,
    ) -> torch.Tensor:
        """Logits of each sequence's last new token (a CUDA-graph step appends its padding rows
        after them); when a request wants prompt logprobs, every token's logits are computed
        and its prompt entries filled from them. Counters are not yet advanced."""
        entries = [_entry(s, block_table) for s in scheduled]
        if self.mrope_deltas is not None:
            entries = self._with_mrope(scheduled, entries)
        lora = any(s.request.sampling_params.lora_adapter is not None for s in scheduled)
        if not any(s.request.needs_prompt_logits for s in scheduled):
            # the captured graphs compute the base model only
            if self.decode_runner is not None and hook is None and not lora:
                logits = self._graph_step(scheduled, entries)
                if logits is not None:
                    return logits
            forward = self._batch(scheduled, entries)
            return self.model.forward(forward, self.kv_pool, layer_hook=hook)
        forward = self._batch(scheduled, entries)
        every = self.model.forward(forward, self.kv_pool, all_logits=True, layer_hook=hook)
        fill_prompt_logprobs(scheduled, every)
        return every[forward.last_token_index]

    def _batch(
        self, scheduled: Sequence[ScheduledRequest], entries: Sequence[SeqEntry]
    ) -> ForwardBatch:
        """The step's batch; with drafts in it, the logits rows are each sequence's last real
        token (in order), then every draft's position (in order): `draft_rows` splits them."""
        forward = ForwardBatch.build(entries, self.block_size, self.device, self.ragged)
        forward = self._with_lora(scheduled, forward)
        drafts = [len(s.request.draft_token_ids) for s in scheduled]
        if not any(drafts):
            return forward
        ends = torch.tensor([s.num_new_tokens for s in scheduled]).cumsum(0) - 1
        main = [int(end) - k for end, k in zip(ends, drafts, strict=True)]
        after = [row + j for row, k in zip(main, drafts, strict=True) for j in range(1, k + 1)]
        rows = torch.tensor(main + after, dtype=torch.long, device=self.device)
        return replace(forward, last_token_index=rows)

    def _with_lora(
        self, scheduled: Sequence[ScheduledRequest], forward: ForwardBatch
    ) -> ForwardBatch:
        names = [s.request.sampling_params.lora_adapter for s in scheduled]
        if all(n is None for n in names):
            return forward
        bank = self.model.lora
        assert bank is not None  # EngineInfo.validate admitted only adapters the bank holds
        slots = [-1 if n is None else bank.slots[n] for n in names]
        return replace(forward, lora=lora_batch(slots, forward.query_lens, self.device))

    def _graph_step(
        self, scheduled: Sequence[ScheduledRequest], entries: Sequence[SeqEntry]
    ) -> torch.Tensor | None:
        """A decode step through the CUDA-graph runner; None when a prefill chunk is in the
        batch or no captured shape fits it."""
        assert self.decode_runner is not None
        if any(len(e.token_ids) != 1 or e.rope_positions is not None for e in entries):
            return None
        rows = [
            DecodeRow(
                s.request.request_id,
                s.request.seq_slot,
                e.token_ids[0],
                e.num_computed,
                e.block_table,
                e.rope_offset,
            )
            for s, e in zip(scheduled, entries, strict=True)
        ]
        return self.decode_runner.run(rows)

    def _with_mrope(
        self, scheduled: Sequence[ScheduledRequest], entries: Sequence[SeqEntry]
    ) -> list[SeqEntry]:
        """The entries with their rope positions and, where a chunk covers an image's
        placeholders, the image's embeddings (every image of the step encoded in one call)."""
        assert self.mrope_deltas is not None
        deltas = self.mrope_deltas
        touched = [
            touched_images(s.request, e.num_computed, len(e.token_ids))
            for s, e in zip(scheduled, entries, strict=True)
        ]
        images = [image for row in touched for image, _, _ in row]
        embeddings = iter(
            [] if not images or self.encoder is None else self.encoder.embeddings(images)
        )
        out = []
        for s, e, row in zip(scheduled, entries, touched, strict=True):
            r = s.request
            delta = deltas.read(r.seq_slot)
            if e.num_computed >= r.prompt_len:  # past the prompt: index + delta on every axis
                out.append(replace(e, rope_offset=delta))
                continue
            rope = rope_positions(r, e.num_computed, len(e.token_ids), delta)
            embeds = tuple((offset, next(embeddings)[rows]) for _, offset, rows in row)
            out.append(replace(e, rope_positions=rope, embeds=embeds))
        return out

    def _encode(self, images: Sequence[PromptImage]) -> list[torch.Tensor]:
        """Each image's embeddings: an encoder node's where it sent them, the others' from one
        vision tower call over all of them."""
        dtype = self.model.dtype
        local = [image for image in images if image.embeddings is None]
        computed = iter(self._run_tower(local) if local else [])
        return [
            next(computed)
            if image.embeddings is None
            else torch.from_numpy(image.embeddings).to(self.device, dtype)
            for image in images
        ]

    def _run_tower(self, images: Sequence[PromptImage]) -> list[torch.Tensor]:
        processor, tower = self.loaded.image_processor, self.model.visual
        assert processor is not None and tower is not None  # the loader sets both for vision
        pictures = [(image.rgb, image.grid) for image in images]
        return run_tower(tower, processor, pictures, self.device, self.model.dtype)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, K and V): (source, destination) pairs."""
        for src, dst in pairs:
            self.kv_pool[:, :, dst].copy_(self.kv_pool[:, :, src])


def draft_rows(
    scheduled: Sequence[ScheduledRequest], logits: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A step's logits split as `ModelRunner._batch` laid them out: one row per sequence, and
    each drafting request's rows after its drafts."""
    drafts = [len(s.request.draft_token_ids) for s in scheduled]
    if not any(drafts):
        return logits, {}
    by_request, row = {}, len(scheduled)
    for s, k in zip(scheduled, drafts, strict=True):
        if k:
            by_request[s.request.request_id] = logits[row : row + k]
            row += k
    return logits[: len(scheduled)], by_request


def rope_positions(request: LlmRequest, start: int, n: int, delta: int) -> np.ndarray | None:
    """[3, n] mRoPE positions of the request's tokens [start, start + n): its prompt's from its
    images' layout, later tokens' their index plus `delta` (the seat's); None when every one is
    its index (a text request)."""
    mm = request.multimodal
    prompt_len = request.prompt_len if mm is not None else 0
    stop = start + n
    if start >= prompt_len and delta == 0:
        return None
    parts = []
    if start < prompt_len:
        parts.append(mm.prompt_positions(start, min(stop, prompt_len)))  # type: ignore[union-attr]
        start = min(stop, prompt_len)
    if start < stop:
        parts.append(np.broadcast_to(np.arange(start, stop) + delta, (3, stop - start)))
    return np.concatenate(parts, axis=1)


def touched_images(request: LlmRequest, start: int, n: int) -> list[tuple[PromptImage, int, slice]]:
    """The request's images whose placeholders fall in tokens [start, start + n): each with the
    index of its first covered token among those n, and the rows of its embeddings covered."""
    mm = request.multimodal
    if mm is None:
        return []
    stop = start + n
    out = []
    for image, span in zip(mm.images, mm.spans, strict=True):
        lo, hi = max(start, span.start), min(stop, span.end)
        if lo < hi:
            out.append((image, lo - start, slice(lo - span.start, hi - span.start)))
    return out


def _entry(s: ScheduledRequest, block_table: Callable[[str], list[int]]) -> SeqEntry:
    r = s.request
    start = r.num_computed_tokens
    tokens = r.all_token_ids + r.draft_token_ids if r.draft_token_ids else r.all_token_ids
    return SeqEntry(
        token_ids=tokens[start : start + s.num_new_tokens],
        num_computed=start,
        block_table=block_table(r.request_id),
    )
