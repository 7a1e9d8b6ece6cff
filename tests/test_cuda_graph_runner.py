"""The CUDA-graph decode path with capture switched off, on CPU: the engine runs every decode
step through the padded static batch (dummy rows on the scratch seat row and scratch block) and
must give the same tokens, the same seat and block accounting and the same outputs as the
plain engine; afterwards everything is conserved. On CPU the engine itself never builds the
runner (the flag is ignored there); the CUDA twin of this test is tests/test_cuda_graphs.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.sampling.sampling_params import SamplingParams
from shared.kv.pool import allocate_kv_pool
from shared.model.cuda_graph_padding import DUMMY_REQUEST_ID
from shared.model.cuda_graph_runner import DecodeGraphRunner, engine_decode_runner
from tests.engine_helpers import pad_decode_steps, random_max_tokens, random_prompts

NUM_BLOCKS = 96
CONFIG = EngineConfig(model="tiny", num_kv_blocks=NUM_BLOCKS, max_batch_size=8, device="cpu")


def padded_engine(config: EngineConfig = CONFIG) -> tuple[EngineCore, DecodeGraphRunner]:
    """An engine whose decode steps go through the runner eagerly (what CUDA captures)."""
    engine = EngineCore(config, role=DecodeSettings())
    assert engine.decode_runner is None, "CPU must keep the eager path"
    return engine, pad_decode_steps(engine, NUM_BLOCKS)


def accounting(engine: EngineCore) -> tuple[int, int, int, int]:
    return (
        engine.seq_slot_manager.num_in_use,
        engine.kv_manager.num_free_blocks,
        engine.sampler.seq_slots_in_use(),
        len(engine.requests),
    )


def test_padded_decode_matches_eager_and_hides_the_dummy() -> None:
    prompts = random_prompts(7, 256, min_len=1, max_len=70, seed=11)
    max_tokens = random_max_tokens(7, lo=2, hi=24, seed=12)
    params = [
        SamplingParams(max_tokens=m, temperature=0.0 if i % 2 else 0.8, seed=i)
        for i, m in enumerate(max_tokens)
    ]
    plain = EngineCore(CONFIG, role=DecodeSettings())
    padded, runner = padded_engine()
    for engine in (plain, padded):
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(p, sp, request_id=f"q{i}")
    seen_padding: set[int] = set()
    tokens: dict[str, dict[str, list[int]]] = {"plain": {}, "padded": {}}
    while plain.has_work or padded.has_work:
        before = runner.num_eager_padded
        for name, engine in (("plain", plain), ("padded", padded)):
            for delta in engine.step():
                assert delta.request_id != DUMMY_REQUEST_ID
                tokens[name].setdefault(delta.request_id, []).extend(delta.token_ids)
        if runner.num_eager_padded > before:
            plan = runner.last_plan
            assert plan is not None
            seen_padding.add(plan.num_padding)
            # a padded step took no seat, no block and no sampler row for its dummies
            assert accounting(padded) == accounting(plain)
            seats = plan.seq_slots[: plan.num_real]
            assert len(set(seats)) == len(seats)  # real rows keep their own, distinct seats
            assert all(s is not None and s < padded.sampler.dummy_slot_row for s in seats)
    assert tokens["padded"] == tokens["plain"]
    assert sorted(tokens["padded"]) == [f"q{i}" for i in range(7)]
    assert seen_padding - {0}, "no step was padded: the test did not exercise dummy rows"
    # the dummies wrote only to the scratch block; the real blocks hold the same K/V
    assert padded.kv_pool[:, :, NUM_BLOCKS].abs().sum() > 0
    torch.testing.assert_close(padded.kv_pool[:, :, :NUM_BLOCKS], plain.kv_pool, rtol=0, atol=1e-5)
    for engine in (plain, padded):
        engine.check_conservation()
        assert engine.shutdown()


def test_runner_leaves_prefill_and_oversized_batches_to_the_eager_path() -> None:
    engine, runner = padded_engine()
    for i, p in enumerate(random_prompts(3, 256, min_len=20, max_len=30, seed=3)):
        engine.add_request(p, SamplingParams(max_tokens=3), request_id=f"p{i}")
    engine.step()  # three prefills: not a decode batch
    assert runner.num_eager_padded == 0
    while engine.has_work:
        engine.step()
    assert runner.num_eager_padded == 2  # two decode steps, padded from 3 to 4 rows
    assert runner.last_plan is not None and runner.last_plan.padded_size == 4
    assert engine.shutdown()


def test_runner_refuses_a_pool_without_the_scratch_block() -> None:
    engine = EngineCore(CONFIG, role=DecodeSettings())
    with pytest.raises(ValueError, match="scratch block"):
        engine_decode_runner(
            engine.model,
            engine.kv_pool,
            max_batch_size=8,
            max_model_len=engine.max_model_len,
            block_size=16,
            dummy_slot_row=engine.sampler.dummy_slot_row,
            scratch_block=NUM_BLOCKS,
            use_graphs=False,
        )
    with pytest.raises(ValueError, match="CUDA"):
        padded_engine_pool = allocate_kv_pool(engine.layout, NUM_BLOCKS + 1, "cpu")
        engine_decode_runner(
            engine.model,
            padded_engine_pool,
            max_batch_size=8,
            max_model_len=engine.max_model_len,
            block_size=16,
            dummy_slot_row=engine.sampler.dummy_slot_row,
            scratch_block=NUM_BLOCKS,
            use_graphs=True,
        )


@pytest.mark.parametrize(("flag", "want"), [([], True), (["--no-cuda-graphs"], False)])
def test_cli_flag_sets_the_config_and_cpu_ignores_it(flag: list[str], want: bool) -> None:
    from pdserve.cli.main import build_parser
    from pdserve.cli.node_command import engine_config

    args = build_parser().parse_args(["prefill", "--device", "cpu", *flag])
    config = engine_config(args)
    assert config.cuda_graphs is want
    engine = EngineCore(replace(config, num_kv_blocks=NUM_BLOCKS), role=DecodeSettings())
    assert engine.decode_runner is None  # CPU: the eager path, the pool without a scratch block
    assert engine.kv_pool.shape[2] == NUM_BLOCKS
