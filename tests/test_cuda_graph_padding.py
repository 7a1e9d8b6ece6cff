"""CUDA-graph padding bookkeeping (pure; runs on CPU): captured sizes, pad-to size, padding
rows on the scratch seat row and the scratch block, and the flat indices the graph reads."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.cdiv import cdiv
from shared.model.cuda_graph_padding import (
    DUMMY_REQUEST_ID,
    DUMMY_TOKEN_ID,
    DecodePadding,
    DecodeRow,
    default_capture_sizes,
    default_kv_buckets,
)
from shared.model.forward_batch import ForwardBatch, SeqEntry

BLOCK = 4
SEATS = 16  # max_num_sequences: the scratch row is 16
SCRATCH = 100  # the pool's extra block; the BlockManager owns 0..99


def padding(sizes: tuple[int, ...] = (1, 2, 4, 8, 16), buckets: tuple[int, ...] = (1, 2, 4, 8)):
    return DecodePadding(sizes, buckets, BLOCK, dummy_slot_row=SEATS, scratch_block=SCRATCH)


def row(i: int, position: int, table: list[int], seat: int | None = None) -> DecodeRow:
    return DecodeRow(f"r{i}", i if seat is None else seat, 10 + i, position, table)


def test_default_capture_sizes() -> None:
    assert default_capture_sizes(1) == (1,)
    assert default_capture_sizes(3) == (1, 2, 3)
    assert default_capture_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert default_capture_sizes(130)[-3:] == (120, 128, 130)
    with pytest.raises(ValueError, match="max_batch_size"):
        default_capture_sizes(0)


def test_default_kv_buckets() -> None:
    assert default_kv_buckets(1) == (1,)
    assert default_kv_buckets(128) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert default_kv_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)


def test_pad_to_is_the_smallest_captured_size_that_fits() -> None:
    p = DecodePadding(default_capture_sizes(32), (1,), BLOCK, SEATS, SCRATCH)
    for n in range(1, 33):
        size = p.pad_to(n)
        assert size is not None and size >= n
        assert all(s < n for s in p.capture_sizes if s < size)
    assert p.pad_to(33) is None
    assert p.pad_to(0) is None


def test_plan_pads_with_dummies_on_the_scratch_row_and_block() -> None:
    rows = [row(0, 5, [7, 3]), row(1, 0, [9]), row(2, 12, [1, 2, 4, 6])]
    plan = padding().plan(rows)
    assert plan is not None
    assert (plan.num_real, plan.padded_size, plan.num_padding) == (3, 4, 1)
    assert plan.kv_blocks == 4  # position 12 needs ceil(13 / 4) = 4 blocks
    assert plan.padding_rows == range(3, 4)
    assert [plan.is_padding(i) for i in range(5)] == [False, False, False, True, False]
    assert plan.request_ids == ("r0", "r1", "r2", DUMMY_REQUEST_ID)
    assert plan.seq_slots == (0, 1, 2, SEATS)
    assert plan.input_ids == (10, 11, 12, DUMMY_TOKEN_ID)
    assert plan.positions == (5, 0, 12, 0)
    assert plan.slot_mapping == (3 * BLOCK + 1, 9 * BLOCK, 6 * BLOCK, SCRATCH * BLOCK)
    # each row's used blocks, padded with its own first block; the dummy reads only scratch
    assert plan.kv_block_ids == (7, 3, 7, 7, 9, 9, 9, 9, 1, 2, 4, 6, *[SCRATCH] * 4)


def test_plan_returns_none_when_no_captured_shape_fits() -> None:
    p = padding()
    assert p.plan([row(i, 0, [i]) for i in range(17)]) is None  # more rows than any graph
    assert p.plan([row(0, 8 * BLOCK, list(range(9)))]) is None  # wider than the widest bucket
    assert p.plan([]) is None


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (row(0, 1, [5], seat=SEATS), "scratch row"),
        (row(0, 1, [5], seat=SEATS + 3), "scratch row"),
        (row(0, 5, [5, SCRATCH]), "scratch block"),
        (DecodeRow(DUMMY_REQUEST_ID, None, 1, 0, [5]), "dummy"),
        (row(0, 4, [5]), "needs 2"),
        (row(0, -1, [5]), "position"),
    ],
)
def test_plan_rejects_a_real_row_on_scratch_resources(bad: DecodeRow, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        padding().plan([row(1, 0, [1]), bad])


@st.composite
def decode_batches(draw: st.DrawFn) -> list[DecodeRow]:
    n = draw(st.integers(1, 16))
    free = list(range(SCRATCH))
    rows = []
    for i in range(n):
        position = draw(st.integers(0, 8 * BLOCK - 1))
        need = cdiv(position + 1, BLOCK)
        extra = draw(st.integers(0, 2))
        if need + extra > len(free):
            break  # the pool is used up: the batch is what fitted
        table = [free.pop(draw(st.integers(0, len(free) - 1))) for _ in range(need + extra)]
        rows.append(DecodeRow(f"r{i}", i, draw(st.integers(0, 999)), position, table))
    return rows


@given(decode_batches())
@settings(max_examples=150, deadline=None)
def test_plan_conserves_rows_and_matches_forward_batch(rows: list[DecodeRow]) -> None:
    p = padding()
    plan = p.plan(rows)
    assert plan is not None
    n, size, width = len(rows), plan.padded_size, plan.kv_blocks
    # conservation: every real row once, in order, then only dummies, every list padded alike
    assert size == p.pad_to(n) and plan.num_real + plan.num_padding == size
    for field in (plan.request_ids, plan.seq_slots, plan.input_ids, plan.positions):
        assert len(field) == size
    assert len(plan.slot_mapping) == size and len(plan.kv_block_ids) == size * width
    assert list(plan.request_ids[:n]) == [r.request_id for r in rows]
    assert list(plan.seq_slots[:n]) == [r.seq_slot for r in rows]
    assert set(plan.request_ids[n:]) <= {DUMMY_REQUEST_ID}
    assert set(plan.seq_slots[n:]) <= {SEATS}  # the scratch row, never a real seat
    assert set(plan.kv_block_ids[n * width :]) <= {SCRATCH}
    assert SCRATCH not in plan.kv_block_ids[: n * width]
    assert all(s // BLOCK != SCRATCH for s in plan.slot_mapping[:n])
    # the width is the smallest bucket covering the longest context
    need = max(cdiv(r.position + 1, BLOCK) for r in rows)
    assert width == min(b for b in p.kv_buckets if b >= need)
    # the real rows' indices are what ForwardBatch computes for the same decode batch
    entries = [SeqEntry([r.token_id], r.position, list(r.block_table)) for r in rows]
    fb = ForwardBatch.build(entries, BLOCK, "cpu")
    assert list(plan.slot_mapping[:n]) == fb.slot_mapping.tolist()
    assert list(plan.positions[:n]) == fb.positions.tolist()
    assert list(plan.input_ids[:n]) == fb.input_ids.tolist()
    # each row reads its used blocks, then repeats its first block (hidden by the causal mask)
    for i, r in enumerate(rows):
        used = list(r.block_table[: cdiv(r.position + 1, BLOCK)])
        got = plan.kv_block_ids[i * width : (i + 1) * width]
        assert list(got) == used + [used[0]] * (width - len(used))


def test_padding_module_imports_no_torch() -> None:
    code = "import sys; import shared.model.cuda_graph_padding; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
