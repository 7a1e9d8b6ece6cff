"""The one-call decode stack (shared/model/decode_stack.py) against the layer loop it replaces,
for the model shapes the loop handles (grouped-query heads, q/k/v, o and MLP biases,
sliding-window layers) at every batch size it takes: in bf16 the same logits and KV pool bit for
bit; in fp32 within rounding, with the same greedy tokens. And it stays out of every step it
does not cover."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.kv.pool import allocate_kv_pool
from shared.model import decode_stack
from shared.model.decode_stack import DecodeStack
from shared.model.forward_batch import ForwardBatch, SeqEntry
from shared.model.gemm import GEMV_ROWS
from shared.model.llama import Model
from shared.model.loader import init_dummy_weights, tiny_config

BF16 = torch.bfloat16
BLOCK = 16
needs_kernel = pytest.mark.skipif(
    not (decode_stack._kernels_on(BF16) and decode_stack._kernels_on(torch.float32)),
    reason="the decode stack cannot run on this machine",
)

VARIANTS = {
    "llama-gqa": {},
    "biases": {"attention_bias": True, "attention_out_bias": True, "mlp_bias": True},
    "window": {"sliding_window": 20, "sliding_window_layers": (1, 3)},
    "mha-64": {"num_heads": 2, "num_kv_heads": 2, "head_dim": 64},
}


def _model(variant: str, dtype: torch.dtype = BF16) -> Model:
    config = dataclasses.replace(tiny_config(), **VARIANTS[variant])
    model = Model(config, "cpu", dtype)
    init_dummy_weights(model, seed=3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norms and biases away from their 1 / 0 init, so that they count
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float64) * 0.1
                param.add_(noise.to(dtype))
    return model


def _decode(
    model: Model, batch_size: int, steps: int, stack: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Logits of `steps` decode steps of `batch_size` sequences after their prefills, the pool
    after them, and how many steps the stack ran."""
    on = decode_stack._kernels_on
    monkeypatch.setattr(decode_stack, "_kernels_on", lambda dtype: stack and on(dtype))
    runs = 0
    real_run = DecodeStack.run

    def counted(self: DecodeStack, *args: object) -> torch.Tensor:
        nonlocal runs
        runs += 1
        return real_run(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeStack, "run", counted)
    pool = allocate_kv_pool(model.config.kv_layout(BLOCK, model.dtype), 24, "cpu")
    prompts = [[(7 * s + 3 * i) % 250 for i in range(21 + 3 * s)] for s in range(batch_size)]
    tables = [list(range(5 * s, 5 * s + 5)) for s in range(batch_size)]
    for prompt, table in zip(prompts, tables, strict=True):
        model(ForwardBatch.build([SeqEntry(prompt, 0, table)], BLOCK, "cpu"), pool)
    logits = []
    for i in range(steps):
        pairs = zip(prompts, tables, strict=True)
        entries = [SeqEntry([(p[i] * 5) % 250], len(p) + i, t) for p, t in pairs]
        logits.append(model(ForwardBatch.build(entries, BLOCK, "cpu"), pool))
    return torch.stack(logits), pool, runs


@needs_kernel
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("batch_size", range(1, GEMV_ROWS[BF16] + 1))
def test_the_stack_equals_the_layer_loop_bitwise(
    variant: str, batch_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(variant)
    steps = 12  # the windowed layers drop keys from the first step on (contexts > 20)
    stacked, stacked_pool, runs = _decode(model, batch_size, steps, True, monkeypatch)
    looped, looped_pool, no_runs = _decode(model, batch_size, steps, False, monkeypatch)
    assert (runs, no_runs) == (steps, 0)
    assert torch.isfinite(stacked).all()
    assert torch.equal(stacked, looped)
    assert torch.equal(stacked_pool, looped_pool)


@needs_kernel
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("batch_size", range(1, GEMV_ROWS[torch.float32] + 1))
def test_fp32_stack_equals_the_layer_loop_within_rounding(
    variant: str, batch_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(variant, torch.float32)
    stacked, stacked_pool, runs = _decode(model, batch_size, 12, True, monkeypatch)
    looped, looped_pool, _ = _decode(model, batch_size, 12, False, monkeypatch)
    assert runs == 12
    torch.testing.assert_close(stacked, looped, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stacked_pool, looped_pool, rtol=1e-5, atol=1e-5)
    assert torch.equal(stacked.argmax(-1), looped.argmax(-1))


@needs_kernel
def test_steps_it_does_not_cover_keep_the_layer_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    bf16 = _model("llama-gqa")
    for dtype in (BF16, torch.float32):  # the loop's GEMMs: oneDNN
        model = bf16 if dtype == BF16 else _model("llama-gqa", dtype)
        assert _decode(model, GEMV_ROWS[dtype] + 1, 2, True, monkeypatch)[2] == 0
    hooked: list[int] = []
    pool = allocate_kv_pool(bf16.config.kv_layout(BLOCK, BF16), 4, "cpu")
    bf16(ForwardBatch.build([SeqEntry([1, 2, 3], 0, [0])], BLOCK, "cpu"), pool)
    batch = ForwardBatch.build([SeqEntry([4], 3, [0])], BLOCK, "cpu")
    bf16(batch, pool, layer_hook=hooked.append)  # a hook runs between layers: the loop
    assert hooked == list(range(bf16.config.num_layers))


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    decode_stack.library.cache_clear()
    monkeypatch.setenv("PDSERVE_DECODE_STACK", "0")
    try:
        assert decode_stack.library() is None
        assert not decode_stack._kernels_on(BF16)
    finally:
        decode_stack.library.cache_clear()


@needs_kernel
def test_layer_loop_pauses_it() -> None:
    with decode_stack.layer_loop():
        assert not decode_stack._kernels_on(BF16)
    assert decode_stack._kernels_on(BF16)


@needs_kernel
def test_a_slot_outside_the_pool_is_refused_before_anything_is_written() -> None:
    model = _model("llama-gqa")
    pool = allocate_kv_pool(model.config.kv_layout(BLOCK, BF16), 4, "cpu")
    model(ForwardBatch.build([SeqEntry([1, 2, 3], 0, [0])], BLOCK, "cpu"), pool)
    batch = ForwardBatch.build([SeqEntry([4], 3, [0])], BLOCK, "cpu")
    batch.slot_mapping.fill_(4 * BLOCK)  # one past the pool's last slot
    before = pool.clone()
    with pytest.raises(IndexError, match="a KV slot outside the pool's 64"):
        model(batch, pool)
    assert torch.equal(pool, before)
