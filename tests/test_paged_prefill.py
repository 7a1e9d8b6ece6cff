"""The paged prefill attention kernel (shared/model/paged_prefill.py) against a float64 reference
from the definition, its dispatch from `paged_attention`, the model through it, its fallbacks."""

from __future__ import annotations

import random

import pytest
import torch

from shared.model import attention, gemm, paged_prefill
from shared.model.forward_batch import ForwardBatch, SeqEntry

needs_kernel = pytest.mark.skipif(
    not paged_prefill.covers(torch.bfloat16),
    reason="no C compiler or no AVX-512 BF16 here: the kernel cannot be used",
)
BF16, F32 = torch.bfloat16, torch.float32
# per element type: where the kernel runs here, and how close to float64 it must come (bf16: the
# output's own rounding and the probabilities' (as SDPA's bf16 kernel rounds them); fp32: sums)
DTYPES = [
    pytest.param(BF16, 2e-2, marks=needs_kernel, id="bf16"),
    pytest.param(
        F32,
        1e-5,
        id="fp32",
        marks=pytest.mark.skipif(
            not paged_prefill.covers(F32),
            reason="fp32 keeps SDPA here (no AVX-512, or fp32 prefill pinned to MKL's bits)",
        ),
    ),
]


def _entries(specs: list[tuple[int, int]], block_size: int, num_blocks: int) -> list[SeqEntry]:
    """(cached tokens, new tokens) per sequence; blocks from a shuffled pool (not in id order)."""
    ids = list(range(num_blocks))
    random.Random(len(specs)).shuffle(ids)
    entries, used = [], 0
    for computed, new in specs:
        count = -(-(computed + new) // block_size)
        entries.append(SeqEntry([1] * new, computed, ids[used : used + count]))
        used += count
    return entries


def _batch(specs: list[tuple[int, int]], block_size: int, num_blocks: int) -> ForwardBatch:
    return ForwardBatch.build(_entries(specs, block_size, num_blocks), block_size, "cpu")


def _reference(
    q: torch.Tensor,
    pool: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    window: int | None,
    tables: list[list[int]],
) -> torch.Tensor:
    """[T, heads * head_dim] in float64, straight from the definition."""
    heads, head_dim, kv_heads, bs = q.shape[1], q.shape[2], pool.shape[-2], pool.shape[2]
    out = torch.zeros(q.shape[0], heads, head_dim, dtype=torch.float64)
    row = 0
    for new, context, table in zip(batch.query_lens, batch.context_lens, tables, strict=True):
        for i in range(new):
            pos = context - new + i
            keys = torch.arange(pos + 1)
            if window is not None:
                keys = keys[keys > pos - window]
            slots = torch.tensor([table[k // bs] for k in keys.tolist()]), keys % bs
            k, v = pool[0][slots].double(), pool[1][slots].double()
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                w = torch.softmax(k[:, kvh] @ q[row, h].double() * scale, dim=0)
                out[row, h] = w @ v[:, kvh]
            row += 1
    return out.view(q.shape[0], heads * head_dim)


SHAPES = [  # heads, kv_heads, head_dim, block_size, (cached, new) per sequence, window
    (9, 3, 64, 16, [(0, 40), (64, 20), (5, 2)], None),
    (4, 2, 32, 16, [(0, 17), (100, 33)], None),
    (4, 4, 64, 8, [(0, 3), (9, 30)], None),
    (8, 2, 128, 16, [(37, 50), (0, 64)], 40),
    (32, 1, 64, 32, [(0, 5), (70, 9)], None),
    (6, 3, 16, 4, [(11, 12)], 5),
]


@pytest.mark.parametrize(("dtype", "tolerance"), DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_the_definition(
    dtype: torch.dtype, tolerance: float, shape: tuple, threads: int
) -> None:
    heads, kv_heads, head_dim, bs, specs, window = shape
    torch.manual_seed(0)
    entries = _entries(specs, bs, 64)
    batch = ForwardBatch.build(entries, bs, "cpu")
    pool = torch.randn(2, 64, bs, kv_heads, head_dim).to(dtype)
    # q as the model has it: a strided view of the fused qkv output
    fused = torch.randn(batch.num_tokens, heads + 2 * kv_heads, head_dim).to(dtype)
    q = fused[:, :heads]
    out = torch.full((batch.num_tokens, heads * head_dim), float("nan"), dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for group in batch.groups:
            assert paged_prefill.usable(q, pool, group)
            assert paged_prefill.prefill_attention(q, pool, group, 0.3, window, out)
    finally:
        torch.set_num_threads(before)
    want = _reference(q, pool, batch, 0.3, window, [e.block_table for e in entries])
    torch.testing.assert_close(out.double(), want, atol=tolerance, rtol=tolerance)


@needs_kernel
def test_prefill_groups_use_the_kernel_and_leave_decode_rows_to_theirs() -> None:
    """A step mixing decodes, a fresh prompt and a continued one: every row equals what its own
    path computes; fp32 takes the kernel exactly where it covers fp32."""
    torch.manual_seed(1)
    batch = _batch([(30, 1), (0, 24), (40, 9), (17, 1)], 16, 32)
    assert len(batch.groups) >= 2
    for dtype in (BF16, torch.float32):
        pool = torch.randn(2, 32, 16, 2, 64).to(dtype)
        fused = torch.randn(batch.num_tokens, 8, 64).to(dtype)
        q, k, v = fused[:, :4], fused[:, 4:6], fused[:, 6:]
        got = attention.paged_attention(
            q, k, v, pool, batch, 0.125, None, attention.GatherScratch()
        )
        for group in batch.groups:
            used = paged_prefill.usable(q, pool, group)
            assert used == (paged_prefill.covers(dtype) and group.query_len > 1)
            if used:
                want = torch.full_like(got, float("nan"))
                assert paged_prefill.prefill_attention(q, pool, group, 0.125, None, want)
                rows = group.token_rows
                assert rows is not None and torch.equal(got[rows], want[rows])


@pytest.mark.parametrize(("dtype", "tolerance"), DTYPES)
def test_model_prefills_through_the_kernel_like_sdpa(
    dtype: torch.dtype, tolerance: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny model: a fresh prompt, then a prompt continuing its cached prefix in two chunks;
    logits through the kernel and through SDPA differ by rounding noise (bf16: most argmaxes
    equal; fp32: every one)."""
    from shared.kv.pool import allocate_kv_pool
    from shared.model.loader import load_model

    loaded = load_model("tiny", torch.device("cpu"), dtype)
    prompt = [random.Random(3).randrange(3, 250) for _ in range(200)]

    def logits(kernel: bool) -> torch.Tensor:
        if not kernel:
            monkeypatch.setattr(paged_prefill, "usable", lambda *a: False)
        pool = allocate_kv_pool(loaded.config.kv_layout(16, dtype), 16, "cpu")
        table = list(range(13))
        rows = []
        for start, end in ((0, 120), (120, 170), (170, 200)):
            batch = ForwardBatch.build([SeqEntry(prompt[start:end], start, table)], 16, "cpu")
            rows.append(loaded.model(batch, pool, all_logits=True).float())
        monkeypatch.undo()
        return torch.cat(rows)

    with_kernel, with_sdpa = logits(True), logits(False)
    assert torch.isfinite(with_kernel).all()
    assert (with_kernel - with_sdpa).abs().max() <= tolerance * with_sdpa.abs().max()
    agree = (with_kernel.argmax(-1) == with_sdpa.argmax(-1)).float().mean()
    assert agree >= (0.9 if dtype == BF16 else 1.0)


def test_fp32_follows_the_prefill_gemms_bit_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where fp32 prefill GEMMs keep MKL's (transformers') bits, fp32 attention keeps SDPA."""
    paged_prefill.covers.cache_clear()
    try:
        monkeypatch.setattr(gemm, "fp32_rows_onednn", lambda: False)
        assert not paged_prefill.covers(F32)
    finally:
        paged_prefill.covers.cache_clear()


def test_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    paged_prefill.library.cache_clear()
    paged_prefill.covers.cache_clear()
    try:
        monkeypatch.setenv("PDSERVE_PAGED_PREFILL", "0")
        assert paged_prefill.library() is None
        batch = _batch([(0, 8)], 16, 4)
        q = torch.zeros(8, 2, 32, dtype=BF16)
        assert not paged_prefill.usable(
            q, torch.zeros(2, 4, 16, 1, 32, dtype=BF16), batch.groups[0]
        )
    finally:
        paged_prefill.library.cache_clear()
        paged_prefill.covers.cache_clear()


@needs_kernel
def test_a_profile_names_the_kernel() -> None:
    """Under torch's profiler the kernel's time is a row of its own (a ctypes call is no aten
    op: the roofline's op table would otherwise leave it out)."""
    batch = _batch([(0, 20)], 16, 4)
    q = torch.randn(20, 2, 32).to(BF16)
    pool, out = torch.randn(2, 4, 16, 1, 32).to(BF16), torch.empty(20, 64, dtype=BF16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert paged_prefill.prefill_attention(q, pool, batch.groups[0], 0.2, None, out)
    assert "pdserve::paged_prefill" in {e.key for e in prof.key_averages()}
