"""Padding a decode batch to a CUDA-graph size — pure bookkeeping: no torch, no I/O.

A CUDA graph replays fixed shapes, so decode steps are captured for a few batch sizes and a
few context widths (KV blocks per sequence), and a batch is padded up to the next captured
size. Padding rows are *dummy requests* (`DUMMY_REQUEST_ID`) that belong to nobody
(docs/seat-system.md §6): each sits on the sampler's scratch row `dummy_slot_row`
(= max_num_sequences, outside the seat pool), computes token 0 at position 0, and writes its
K/V into one scratch block that lies past the BlockManager's blocks. No seat, no block, no
request object is ever registered for it, so it cannot show in outputs, metrics or block
accounting — the reason TensorRT-LLM's SeqSlotManager gives the dummy no seat.

`DecodePadding.plan(rows)` turns a decode batch into the flat index lists the graph's static
inputs are filled from (the same layout `ForwardBatch` builds for one decode group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.cdiv import cdiv

# the request id of a padding row: it belongs to nobody, and its seat is the scratch row that
# SlotManager hands out again and again (shared/engine/resources/resource_manager.py)
DUMMY_REQUEST_ID = "__pdserve_dummy__"

DUMMY_TOKEN_ID = 0  # any valid id: its logits are discarded


def default_capture_sizes(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8, up to and including `max_batch_size`: padding
    wastes at most 7 rows past 8 (vLLM's schedule)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = {n for n in (1, 2, 4) if n < max_batch_size}
    sizes.update(range(8, max_batch_size, 8))
    sizes.add(max_batch_size)
    return tuple(sorted(sizes))


def default_kv_buckets(max_blocks_per_seq: int) -> tuple[int, ...]:
    """Context widths in blocks: powers of two, then `max_blocks_per_seq`. A decode step's
    attention reads Kmax keys per row, so doubling widths cost at most 2x its attention."""
    if max_blocks_per_seq < 1:
        raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
    widths = set()
    w = 1
    while w < max_blocks_per_seq:
        widths.add(w)
        w *= 2
    widths.add(max_blocks_per_seq)
    return tuple(sorted(widths))


def _next_at_least(n: int, sizes: Sequence[int]) -> int | None:
    return next((s for s in sizes if s >= n), None)


@dataclass(frozen=True)
class DecodeRow:
    """One real sequence's decode step: one new token at `position` (= tokens already in the
    pool), on seat `seq_slot`, over `block_table`; rope turns it by `position + rope_offset`
    (an mRoPE request's delta; 0 elsewhere)."""

    request_id: str
    seq_slot: int | None
    token_id: int
    position: int
    block_table: Sequence[int]
    rope_offset: int = 0


@dataclass(frozen=True)
class PaddingPlan:
    """A decode batch padded to a captured graph shape (`padded_size` rows x `kv_blocks`).

    Rows `[0, num_real)` are the batch in order; rows `[num_real, padded_size)` are dummies.
    The flat lists fill the graph's static inputs; `kv_block_ids` is `padded_size` rows of
    `kv_blocks` block ids (each row padded with its own first block, which the causal mask
    hides, as `ForwardBatch` does).
    """

    num_real: int
    padded_size: int
    kv_blocks: int
    request_ids: tuple[str, ...]
    seq_slots: tuple[int | None, ...]
    input_ids: tuple[int, ...]
    positions: tuple[int, ...]
    slot_mapping: tuple[int, ...]
    kv_block_ids: tuple[int, ...]
    rope_positions: tuple[int, ...]  # positions + each row's rope offset

    @property
    def num_padding(self) -> int:
        return self.padded_size - self.num_real

    @property
    def padding_rows(self) -> range:
        return range(self.num_real, self.padded_size)

    def is_padding(self, row: int) -> bool:
        return self.num_real <= row < self.padded_size


class DecodePadding:
    """Which decode batches a captured graph can run, and how to pad them.

    `scratch_block` is the pool block (past the BlockManager's `num_blocks`) that dummy rows
    write to; `dummy_slot_row` is the sampler's scratch row.
    """

    def __init__(
        self,
        capture_sizes: Sequence[int],
        kv_buckets: Sequence[int],
        block_size: int,
        dummy_slot_row: int,
        scratch_block: int,
    ):
        if not capture_sizes or min(capture_sizes) < 1:
            raise ValueError(f"capture sizes must be positive, got {list(capture_sizes)}")
        if not kv_buckets or min(kv_buckets) < 1:
            raise ValueError(f"KV buckets must be positive, got {list(kv_buckets)}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.capture_sizes = tuple(sorted(set(capture_sizes)))
        self.kv_buckets = tuple(sorted(set(kv_buckets)))
        self.block_size = block_size
        self.dummy_slot_row = dummy_slot_row
        self.scratch_block = scratch_block

    @property
    def max_batch_size(self) -> int:
        return self.capture_sizes[-1]

    def pad_to(self, num_rows: int) -> int | None:
        """The captured batch size a batch of `num_rows` runs at; None: too big (eager)."""
        return _next_at_least(num_rows, self.capture_sizes) if num_rows >= 1 else None

    def kv_bucket(self, num_blocks: int) -> int | None:
        """The captured width for rows needing up to `num_blocks` blocks; None: too long."""
        return _next_at_least(max(num_blocks, 1), self.kv_buckets)

    def plan(self, rows: Sequence[DecodeRow]) -> PaddingPlan | None:
        """Pad `rows` to the next captured shape; None when no captured graph fits."""
        padded = self.pad_to(len(rows))
        if padded is None:
            return None
        for row in rows:
            self._check_real(row)
        need = max(cdiv(r.position + 1, self.block_size) for r in rows)
        width = self.kv_bucket(need)
        if width is None:
            return None
        bs = self.block_size
        tables = [self._row_blocks(r.block_table, r.position, width) for r in rows]
        pairs = zip(rows, tables, strict=True)
        slots = [t[r.position // bs] * bs + r.position % bs for r, t in pairs]
        dummies = padded - len(rows)
        kv_ids = [b for t in tables for b in t] + [self.scratch_block] * (width * dummies)
        return PaddingPlan(
            num_real=len(rows),
            padded_size=padded,
            kv_blocks=width,
            request_ids=(*(r.request_id for r in rows), *([DUMMY_REQUEST_ID] * dummies)),
            seq_slots=(*(r.seq_slot for r in rows), *([self.dummy_slot_row] * dummies)),
            input_ids=(*(r.token_id for r in rows), *([DUMMY_TOKEN_ID] * dummies)),
            positions=(*(r.position for r in rows), *([0] * dummies)),
            slot_mapping=(*slots, *([self.scratch_block * bs] * dummies)),
            kv_block_ids=tuple(kv_ids),
            rope_positions=(*(r.position + r.rope_offset for r in rows), *([0] * dummies)),
        )

    def _check_real(self, row: DecodeRow) -> None:
        """A real row never sits on the scratch row nor reads or writes the scratch block."""
        if row.request_id == DUMMY_REQUEST_ID:
            raise ValueError("the padding dummy cannot be a row of the real batch")
        if row.seq_slot is not None and row.seq_slot >= self.dummy_slot_row:
            raise ValueError(
                f"request {row.request_id} sits on seat {row.seq_slot}, at or past the "
                f"scratch row {self.dummy_slot_row}"
            )
        if row.position < 0:
            raise ValueError(f"request {row.request_id}: position must be >= 0")
        need = cdiv(row.position + 1, self.block_size)
        if len(row.block_table) < need:
            raise ValueError(
                f"request {row.request_id}: block table has {len(row.block_table)} blocks, "
                f"position {row.position} needs {need}"
            )
        if self.scratch_block in row.block_table[:need]:
            raise ValueError(f"request {row.request_id} holds the scratch block")

    def _row_blocks(self, table: Sequence[int], position: int, width: int) -> list[int]:
        used = list(table[: cdiv(position + 1, self.block_size)])
        return used + [used[0]] * (width - len(used))
