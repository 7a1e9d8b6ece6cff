"""The paged decode attention kernel (shared/model/paged_decode.py) against a float64 reference
computed from the gathered K/V, its dispatch from `paged_attention`, and its fallbacks."""

from __future__ import annotations

import logging
import random
import shutil

import pytest
import torch

from shared.model import attention, native, paged_decode
from shared.model.attention_groups import AttentionGroup
from shared.model.forward_batch import ForwardBatch, SeqEntry

needs_kernel = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler here: the kernel cannot be built"
)


def _batch(
    contexts: list[int], block_size: int, num_blocks: int, seed: int, ragged: bool = False
) -> ForwardBatch:
    """One decode token per sequence, blocks taken from a shuffled pool (not in id order)."""
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    entries, used = [], 0
    for n in contexts:
        count = -(-n // block_size)
        entries.append(SeqEntry([1], n - 1, ids[used : used + count]))
        used += count
    return ForwardBatch.build(entries, block_size, "cpu", ragged_decode=ragged)


def _reference(
    q: torch.Tensor, pool: torch.Tensor, group: AttentionGroup, scale: float, window: int | None
) -> torch.Tensor:
    """[G, heads * head_dim] in float64 for one group's sequences, straight from the definition."""
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], pool.shape[-2]
    bs = pool.shape[2]
    assert group.kv_blocks is not None
    tables = group.kv_blocks.view(len(group.seq_ids), -1).tolist()
    rows = []
    for g, (pos, table) in enumerate(zip(group.query_pos[:, 0].tolist(), tables, strict=True)):
        keys = torch.arange(pos + 1)
        if window is not None:
            keys = keys[keys > pos - window]
        slots = torch.tensor([table[k // bs] for k in keys.tolist()]), keys % bs
        k, v = pool[0][slots].double(), pool[1][slots].double()  # [n, kv_heads, head_dim]
        query = q[group.seq_ids[g]].double()
        out = []
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            w = torch.softmax(k[:, kvh] @ query[h] * scale, dim=0)
            out.append(w @ v[:, kvh])
        rows.append(torch.cat(out))
    return torch.stack(rows).view(-1, heads * head_dim)


SHAPES = [  # heads, kv_heads, head_dim, block_size, contexts, window
    (8, 2, 64, 16, [2, 17, 33, 100], None),
    (4, 4, 32, 4, [5, 9, 40], None),
    (9, 3, 64, 16, [300, 257, 16], None),
    (6, 1, 80, 8, [70, 3], 5),
    (4, 2, 128, 16, [48, 130], 40),
]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_the_definition(dtype: torch.dtype, shape: tuple, threads: int) -> None:
    heads, kv_heads, head_dim, bs, contexts, window = shape
    torch.manual_seed(0)
    batch = _batch(contexts, bs, 64, seed=len(contexts))
    pool = torch.randn(2, 64, bs, kv_heads, head_dim).to(dtype)
    # q as the model has it: a strided view of the fused qkv output
    fused = torch.randn(len(contexts), heads + 2 * kv_heads, head_dim).to(dtype)
    q = fused[:, :heads]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = [paged_decode.decode_attention(q, pool, g, 0.3, window) for g in batch.groups]
    finally:
        torch.set_num_threads(before)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    for group, out in zip(batch.groups, got, strict=True):
        assert out is not None and out.dtype == dtype
        want = _reference(q, pool, group, 0.3, window)
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@needs_kernel
def test_paged_attention_uses_the_kernel_for_decode_groups() -> None:
    torch.manual_seed(1)
    batch = _batch([40, 45, 37], 16, 32, seed=3)  # alike: one group
    (group,) = batch.groups
    for dtype in (torch.bfloat16, torch.float32):
        pool = torch.randn(2, 32, 16, 2, 64).to(dtype)
        q = torch.randn(3, 4, 64).to(dtype)
        k = v = torch.zeros(3, 2, 64, dtype=dtype)  # unused by a pool group
        scratch = attention.GatherScratch()
        got = attention.paged_attention(q, k, v, pool, batch, 0.125, None, scratch)
        want = paged_decode.decode_attention(q, pool, group, 0.125, None)
        assert want is not None and torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ragged_decode_rows_are_one_group_with_the_same_outputs(dtype: torch.dtype) -> None:
    """Where the kernel runs decode (the engine asks `reads_ragged`), decode rows of any lengths
    form one group: one call instead of one per length band, the same bits per sequence."""
    contexts = [300, 6, 40, 17, 129]
    banded, ragged = (_batch(contexts, 16, 64, seed=5, ragged=r) for r in (False, True))
    assert len(banded.groups) > 1 and len(ragged.groups) == 1
    assert paged_decode.reads_ragged(torch.device("cpu"), dtype)
    torch.manual_seed(2)
    pool = torch.randn(2, 64, 16, 3, 64).to(dtype)
    q = torch.randn(len(contexts), 9, 64).to(dtype)
    k = v = torch.zeros(len(contexts), 3, 64, dtype=dtype)  # unused by a pool group
    outs = [
        attention.paged_attention(q, k, v, pool, b, 0.125, None, attention.GatherScratch())
        for b in (banded, ragged)
    ]
    assert torch.equal(*outs)


def test_prefill_groups_never_use_the_kernel() -> None:
    entries = [SeqEntry([1, 2, 3], 16, [0, 1]), SeqEntry([4, 5], 0, [2])]
    batch = ForwardBatch.build(entries, 16, "cpu")
    q = torch.zeros(5, 4, 64, dtype=torch.bfloat16)
    pool = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    assert not any(paged_decode.usable(q, pool, g) for g in batch.groups)


@pytest.fixture
def fresh_library():
    paged_decode.library.cache_clear()
    yield
    paged_decode.library.cache_clear()


def test_switch_and_missing_compiler_fall_back_to_sdpa(
    fresh_library: None, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("PDSERVE_PAGED_DECODE", "0")
    assert paged_decode.library() is None
    paged_decode.library.cache_clear()
    monkeypatch.delenv("PDSERVE_PAGED_DECODE")
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))  # no library built ahead
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert paged_decode.library() is None
    batch = _batch([10], 16, 4, seed=0)
    q = torch.zeros(1, 2, 32, dtype=torch.bfloat16)
    assert not paged_decode.usable(q, torch.zeros(2, 4, 16, 1, 32).to(q.dtype), batch.groups[0])


def test_failed_build_is_logged_and_falls_back(
    fresh_library: None, monkeypatch: pytest.MonkeyPatch, tmp_path, caplog
) -> None:
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    with caplog.at_level(logging.WARNING):
        assert paged_decode.library() is None
    assert "paged decode kernel unavailable" in caplog.text
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind


@needs_kernel
def test_loading_the_kernel_keeps_denormals(
    fresh_library: None, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """A library linked with -ffast-math would switch the process to flush-to-zero on load,
    changing torch's fp32 arithmetic everywhere (the parity tests' bits)."""
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    assert paged_decode.library() is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 2).item() != 0.0 and (tiny / 2).item() != 0.0


@needs_kernel
def test_build_is_cached_per_machine(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    cc = shutil.which("cc")
    assert cc is not None
    first = native.build("paged_decode", cc)
    stamp = first.stat().st_mtime_ns
    assert native.build("paged_decode", cc) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no build directory left


@needs_kernel
def test_bf16_model_decodes_through_the_kernel_like_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model in bf16, three sequences decoding together: logits through the kernel and
    through gather + SDPA differ by bf16 noise only, and pick the same tokens."""
    from shared.kv.pool import allocate_kv_pool
    from shared.model.loader import load_model

    loaded = load_model("tiny", torch.device("cpu"), torch.bfloat16)
    prompts = [list(range(3, 43)), list(range(50, 71)), list(range(100, 133))]

    def decode(kernel: bool) -> torch.Tensor:
        monkeypatch.setattr(paged_decode, "KERNEL_DTYPES", (torch.bfloat16,) if kernel else ())
        pool = allocate_kv_pool(loaded.config.kv_layout(16, torch.bfloat16), 16, "cpu")
        tables = [[0, 1, 2], [3, 4], [5, 6, 7]]
        for p, t in zip(prompts, tables, strict=True):
            loaded.model(ForwardBatch.build([SeqEntry(p, 0, t)], 16, "cpu"), pool)
        steps = []
        for i in range(6):
            pairs = zip(prompts, tables, strict=True)
            entries = [SeqEntry([p[i]], len(p) + i, t) for p, t in pairs]
            steps.append(loaded.model(ForwardBatch.build(entries, 16, "cpu"), pool).float())
        return torch.stack(steps)

    with_kernel, with_sdpa = decode(True), decode(False)
    assert torch.isfinite(with_kernel).all()
    assert (with_kernel - with_sdpa).abs().max() <= 0.02 * with_sdpa.abs().max()
    assert (with_kernel.argmax(-1) == with_sdpa.argmax(-1)).float().mean() >= 0.9
