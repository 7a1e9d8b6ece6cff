"""Decode steps through CUDA graphs: static inputs, capture once per shape, replay.

A decode step of a small model is dominated by kernel launches (a few hundred per step), not by
the GPU's work; a captured graph launches them all at once. `DecodeGraphRunner.run` pads the
batch (`DecodePadding`: dummy rows on the scratch seat row and the scratch KV block), copies the
step's indices into static device buffers with one host-to-device copy, and replays the graph
captured for that (batch size, context width), capturing it on first use. Batches no graph fits
(a prefill chunk in the batch, too many rows, too long a context) return None: the caller runs
them eagerly.

`use_graphs=False` runs the same padded static batch eagerly (any device): that is how the
padding is tested on CPU; capture and replay are the only CUDA-only part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from shared.cdiv import cdiv
from shared.model.attention import GatherScratch
from shared.model.attention_groups import AttentionGroup
from shared.model.cuda_graph_padding import (
    DecodePadding,
    DecodeRow,
    PaddingPlan,
    default_capture_sizes,
    default_kv_buckets,
)
from shared.model.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from shared.model.llama import Model


class DecodeGraphRunner:
    def __init__(
        self,
        model: Model,
        kv_pool: torch.Tensor,
        padding: DecodePadding,
        *,
        use_graphs: bool,
    ):
        if padding.scratch_block >= kv_pool.shape[2]:
            raise ValueError(
                f"scratch block {padding.scratch_block} is outside the pool's "
                f"{kv_pool.shape[2]} blocks"
            )
        if use_graphs and kv_pool.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and KV pool on a CUDA device")
        self.model = model
        self.kv_pool = kv_pool
        self.padding = padding
        self.use_graphs = use_graphs
        self.device = kv_pool.device
        bmax, wmax = padding.max_batch_size, padding.kv_buckets[-1]
        self._bmax = bmax
        # [ids | positions | rope positions | slots], bmax each, then bmax * wmax KV block ids:
        # one H2D copy
        numel = 4 * bmax + bmax * wmax
        self._inputs = torch.zeros(numel, dtype=torch.long, device=self.device)
        pin = self.device.type == "cuda"
        self._staging = torch.zeros(numel, dtype=torch.long, pin_memory=pin) if pin else None
        self._copied: torch.cuda.Event | None = None
        self._last_token_index = torch.arange(bmax, device=self.device)
        self._kv_pos = torch.arange(wmax * padding.block_size, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._mempool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.num_captures = 0
        self.num_replays = 0
        self.num_eager_padded = 0
        self.last_plan: PaddingPlan | None = None

    # ---- the step -------------------------------------------------------------------------
    def run(self, rows: Sequence[DecodeRow]) -> torch.Tensor | None:
        """fp32 logits `[padded_size, vocab]` (real rows first, padding after), or None when
        no captured shape fits this batch. The tensor is the graph's static output: read it
        before the next step."""
        plan = self.padding.plan(rows)
        if plan is None:
            return None
        self.last_plan = plan
        self._fill(plan)
        key = (plan.padded_size, plan.kv_blocks)
        if not self.use_graphs:
            self.num_eager_padded += 1
            return self.model.forward(self._static_batch(*key), self.kv_pool)
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)
        graph, logits = self._graphs[key]
        graph.replay()
        self.num_replays += 1
        return logits

    def _fill(self, plan: PaddingPlan) -> None:
        bmax, pad = self._bmax, [0] * (self._bmax - plan.padded_size)
        flat = [
            *plan.input_ids,
            *pad,
            *plan.positions,
            *pad,
            *plan.rope_positions,
            *pad,
            *plan.slot_mapping,
            *pad,
            *plan.kv_block_ids,
        ]
        host = torch.tensor(flat, dtype=torch.long)
        n = 4 * bmax + len(plan.kv_block_ids)
        if self._staging is None:
            self._inputs[:n].copy_(host)
            return
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the staging buffer
        self._staging[:n].copy_(host)
        self._inputs[:n].copy_(self._staging[:n], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))

    # ---- static shapes --------------------------------------------------------------------
    def _static_batch(self, size: int, width: int) -> ForwardBatch:
        """A ForwardBatch whose tensors are views of the static inputs: one decode group of
        `size` rows over `width` blocks each. Built anew per use, so its mask cache starts empty
        (a mask built outside a capture would be frozen into the graph)."""
        bmax, bs = self._bmax, self.padding.block_size
        ids = self._inputs[:size]
        positions = self._inputs[bmax : bmax + size]
        rope = self._inputs[2 * bmax : 2 * bmax + size]
        slots = self._inputs[3 * bmax : 3 * bmax + size]
        kv_blocks = self._inputs[4 * bmax : 4 * bmax + size * width]
        group = AttentionGroup(
            seq_ids=list(range(size)),
            query_len=1,
            kv_len=width * bs,
            fresh=False,
            kv_blocks=kv_blocks,
            query_pos=positions.view(size, 1),
            kv_pos=self._kv_pos[: width * bs],
            query_rows=None,
            query_valid=None,
            token_rows=None,
        )
        return ForwardBatch(
            num_seqs=size,
            num_tokens=size,
            query_lens=[1] * size,
            context_lens=[width * bs] * size,  # the padded width; the model reads tensors only
            input_ids=ids,
            positions=positions,
            slot_mapping=slots,
            last_token_index=self._last_token_index[:size],
            groups=[group],
            block_size=bs,
            rope_positions=rope,  # the positions themselves but for an mRoPE request's delta
        )

    def _capture(self, size: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (as torch.cuda.graphs asks), then capture. The warm-up runs
        the step's real inputs, which are already in the static buffers: it writes the same K/V
        the replay writes, to the same slots."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model.forward(self._static_batch(size, width), self.kv_pool)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # The gather buffer is allocated inside the capture, from the graphs' private pool: the
        # model's own buffer may be freed and its memory reused (it grows with eager batches),
        # while a replay would still write there.
        scratch = GatherScratch()
        # thread_local: the KV receiver may issue CUDA calls from its own thread meanwhile
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            batch = self._static_batch(size, width)
            logits = self.model.forward(batch, self.kv_pool, scratch=scratch)
        self.num_captures += 1
        return graph, logits

    @property
    def captured_shapes(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)


def engine_decode_runner(
    model: Model,
    kv_pool: torch.Tensor,
    *,
    max_batch_size: int,
    max_model_len: int,
    block_size: int,
    dummy_slot_row: int,
    scratch_block: int,
    use_graphs: bool = True,
) -> DecodeGraphRunner:
    """The runner an engine uses: every batch size up to `max_batch_size`, every context up
    to `max_model_len`; graphs are captured lazily, the first time a shape is seen."""
    padding = DecodePadding(
        default_capture_sizes(max_batch_size),
        default_kv_buckets(cdiv(max_model_len, block_size)),
        block_size,
        dummy_slot_row,
        scratch_block,
    )
    return DecodeGraphRunner(model, kv_pool, padding, use_graphs=use_graphs)
