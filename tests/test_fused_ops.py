"""The fused kernels (shared/model/fused_ops.py) against the torch formulas they replace. bf16:
RoPE + KV store bit for bit; RMSNorm and SwiGLU within two bf16 steps of torch's (their sum / exp
run in another order, and a one-step difference can grow by one through the rounding after
it), in a tiny share of elements. fp32: within rounding, and only where fp32 has already left
transformers' bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model import fused_ops, gemm
from shared.model.config import ModelConfig
from shared.model.llama import RMSNorm, RotaryEmbedding, apply_rotary, write_kv
from tests.engine_helpers import torch_threads

needs_kernel = pytest.mark.skipif(
    fused_ops.library() is None, reason="no C compiler: the fused kernels cannot be built"
)
BF16, F32 = torch.bfloat16, torch.float32


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps (both finite, compared through their bit patterns)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _rope(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin as the model builds them for a step (llama.RotaryEmbedding)."""
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=head_dim,
        intermediate_size=head_dim,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=head_dim,
    )
    return RotaryEmbedding(config, torch.device("cpu"))(positions, BF16)


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 5, 300])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rope_store_equals_apply_rotary_and_write_kv_bitwise(
    tokens: int, heads: int, kv_heads: int, head_dim: int, threads: int
) -> None:
    gen = torch.Generator().manual_seed(tokens + heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(BF16)
    rope = _rope(torch.randint(0, 5000, (tokens,), generator=gen), head_dim)
    pool = torch.randn(2, 40, 16, kv_heads, head_dim, generator=gen).to(BF16)
    slots = torch.randperm(640, generator=gen)[:tokens]
    theirs = pool.clone()
    split = qkv.view(tokens, heads + 2 * kv_heads, head_dim)
    expected = apply_rotary(split[:, : heads + kv_heads], *rope)
    write_kv(theirs, slots, expected[:, heads:], split[:, heads + kv_heads :])
    with torch_threads(threads):
        got = fused_ops.rope_store(qkv, heads, rope, pool, slots)
    assert torch.equal(got, expected)
    assert torch.equal(pool, theirs)  # the new tokens' slots, and nothing else


@needs_kernel
def test_rope_store_rejects_a_slot_outside_the_pool_before_writing() -> None:
    qkv = torch.ones(2, 3 * 32, dtype=BF16)
    pool = torch.zeros(2, 4, 16, 1, 32, dtype=BF16)
    with pytest.raises(IndexError, match="outside the pool's 64 slots"):
        fused_ops.rope_store(qkv, 1, _rope(torch.arange(2), 32), pool, torch.tensor([3, 64]))
    assert not pool.any()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 32, 700])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_add_then_rms_norm(rows: int, with_delta: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    dim = 576
    x = (3 * torch.randn(rows, dim, generator=gen)).to(BF16)
    delta = torch.randn(rows, dim, generator=gen).to(BF16) if with_delta else None
    norm = RMSNorm(dim, 1e-5, torch.device("cpu"), BF16)
    with torch.no_grad():
        norm.weight.copy_((1 + 0.3 * torch.randn(dim, generator=gen)).to(BF16))
    theirs_x = x.clone() if delta is None else x.clone().add_(delta)
    expected = norm(theirs_x)
    got = fused_ops.add_rms_norm(x, delta, norm.weight, 1e-5)
    assert torch.equal(x, theirs_x)  # the residual add is torch's, bit for bit
    assert _ulps(got, expected).max() <= 2  # one step, through a second rounding
    assert (got != expected).float().mean() <= 1e-3


@needs_kernel
@pytest.mark.parametrize("rows", [1, 32, 512])
def test_silu_mul_matches_silu_times_up(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * 1536, generator=gen)).to(BF16)
    gate, up = gate_up.split(1536, dim=-1)
    expected = F.silu(gate).mul_(up)
    got = fused_ops.silu_mul(gate_up, 1536)
    assert _ulps(got, expected).max() <= 2  # one step, through a second rounding
    # bf16 inputs repeat: one gate value whose SiLU lies on a bf16 rounding tie (5.9375 here)
    # differs in every row it appears in
    assert (got != expected).float().mean() <= 5e-3


@needs_kernel
def test_threads_do_not_change_results() -> None:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(900, 576, generator=gen).to(BF16)
    weight = torch.rand(576, generator=gen).to(BF16)
    gate_up = torch.randn(900, 3072, generator=gen).to(BF16)
    outs = []
    for threads in (1, 2):
        with torch_threads(threads):
            outs.append(
                (
                    fused_ops.add_rms_norm(x.clone(), x, weight, 1e-6),
                    fused_ops.silu_mul(gate_up, 1536),
                )
            )
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_fp32_runs_fused_only_where_it_left_transformers_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fp32 takes the kernels where its prefill GEMMs already left MKL's bits (CPUs not
    Intel's); with `PDSERVE_FP32_GEMM=mkl` (transformers' bits asked for) it keeps torch's ops."""
    x = torch.zeros(2, 8)
    gemm.fp32_rows_onednn.cache_clear()
    try:
        assert fused_ops.usable(x) == (fused_ops.library() is not None and gemm.fp32_rows_onednn())
        monkeypatch.setenv("PDSERVE_FP32_GEMM", "mkl")
        gemm.fp32_rows_onednn.cache_clear()
        assert not fused_ops.usable(x)
    finally:
        monkeypatch.delenv("PDSERVE_FP32_GEMM")
        gemm.fp32_rows_onednn.cache_clear()


def test_the_switch_keeps_the_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    fused_ops.library.cache_clear()
    monkeypatch.setenv("PDSERVE_FUSED_OPS", "0")
    try:
        assert fused_ops.library() is None
        assert not fused_ops.usable(torch.zeros(2, 8, dtype=BF16))
        assert not fused_ops.usable(torch.zeros(2, 8))
    finally:
        fused_ops.library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 33, 700])
@pytest.mark.parametrize("threads", [1, 2])
def test_fp32_kernels_match_the_torch_formulas(rows: int, threads: int) -> None:
    """fp32: the same formulas, only sums and exp evaluated in another order."""
    gen = torch.Generator().manual_seed(rows)
    dim, inter, heads, kv_heads, head_dim = 576, 1536, 9, 3, 64
    x, delta = 3 * torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)
    norm = RMSNorm(dim, 1e-5, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=gen))
    gate_up = 4 * torch.randn(rows, 2 * inter, generator=gen)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)
    rope = tuple(t.float() for t in _rope(torch.randint(0, 5000, (rows,), generator=gen), 64))
    pool = torch.randn(2, 50, 16, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(800, generator=gen)[:rows]
    theirs_pool, theirs_x = pool.clone(), x + delta
    split = qkv.view(rows, heads + 2 * kv_heads, head_dim)
    rotated = apply_rotary(split[:, : heads + kv_heads], *rope)
    write_kv(theirs_pool, slots, rotated[:, heads:], split[:, heads + kv_heads :])
    with torch_threads(threads):
        normed = fused_ops.add_rms_norm(x, delta, norm.weight, 1e-5)
        product = fused_ops.silu_mul(gate_up, inter)
        qk = fused_ops.rope_store(qkv, heads, rope, pool, slots)
    gate, up = gate_up.split(inter, dim=-1)
    assert torch.equal(x, theirs_x)
    torch.testing.assert_close(normed, norm(theirs_x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(product, F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qk, rotated, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool, theirs_pool, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(pool.view(2, -1, kv_heads, head_dim).shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(
        pool.view(2, -1, kv_heads, head_dim)[:, untouched],
        theirs_pool.view(2, -1, kv_heads, head_dim)[:, untouched],
    )


@needs_kernel
@pytest.mark.parametrize(("dtype", "tolerance", "agreement"), [(BF16, 0.02, 0.9), (F32, 1e-5, 1.0)])
def test_model_through_the_fused_kernels_matches_the_torch_ops(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, tolerance: float, agreement: float
) -> None:
    """The tiny model: a prefill and decode steps through the kernels and through the torch ops
    give logits that differ by rounding noise only and pick the same tokens (fp32: every one)."""
    from shared.kv.pool import allocate_kv_pool
    from shared.model.forward_batch import ForwardBatch, SeqEntry
    from shared.model.loader import load_model

    monkeypatch.setenv("PDSERVE_FP32_GEMM", "onednn")  # fp32: where its kernels run
    gemm.fp32_rows_onednn.cache_clear()
    loaded = load_model("tiny", torch.device("cpu"), dtype)
    prompts = [list(range(3, 43)), list(range(50, 71))]
    tables = [[0, 1, 2], [3, 4]]

    def run(fused: bool) -> torch.Tensor:
        monkeypatch.setattr(fused_ops, "KERNEL_DTYPES", (dtype,) if fused else ())
        pool = allocate_kv_pool(loaded.config.kv_layout(16, dtype), 8, "cpu")
        entries = [SeqEntry(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
        steps = [loaded.model(ForwardBatch.build(entries, 16, "cpu"), pool)]
        for i in range(4):
            pairs = zip(prompts, tables, strict=True)
            entries = [SeqEntry([p[i]], len(p) + i, t) for p, t in pairs]
            steps.append(loaded.model(ForwardBatch.build(entries, 16, "cpu"), pool))
        return torch.stack(steps).float()

    try:
        fused, torch_ops = run(True), run(False)
    finally:
        monkeypatch.delenv("PDSERVE_FP32_GEMM")
        gemm.fp32_rows_onednn.cache_clear()
    assert torch.isfinite(fused).all()
    if dtype == F32:  # the kernels ran: their sums in another order (bf16 rounds that away)
        assert not torch.equal(fused, torch_ops)
    assert (fused - torch_ops).abs().max() <= tolerance * torch_ops.abs().max()
    assert (fused.argmax(-1) == torch_ops.argmax(-1)).float().mean() >= agreement
