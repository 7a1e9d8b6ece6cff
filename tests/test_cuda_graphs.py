"""CUDA graphs on vs off on a GPU: the same requests give the same tokens, the dummies write
only the scratch block and take no seat or block, everything is conserved. The CPU twin
(padding run eagerly) is tests/test_cuda_graph_runner.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.cuda_graph_padding import DUMMY_REQUEST_ID
from shared.model.loader import load_model
from tests.cuda_facts import CUDA_MARKS, record
from tests.engine_helpers import random_max_tokens, random_prompts

pytestmark = CUDA_MARKS
NUM_BLOCKS = 512


def run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(p, sp, request_id=f"q{i}")
    tokens: dict[str, list[int]] = {}
    while core.has_work:
        for delta in core.step():
            assert delta.request_id != DUMMY_REQUEST_ID
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            # the dummies never hold a seat: only live requests do
            assert core.seq_slot_manager.num_in_use <= len(core.requests)
    return tokens


def cuda_engine(path: Path, dtype: str, graphs: bool, max_batch_size: int) -> EngineCore:
    """A decode engine on the GPU over `path`, with CUDA graphs on or off."""
    config = EngineConfig(
        model=str(path),
        num_kv_blocks=NUM_BLOCKS,
        max_batch_size=max_batch_size,
        device="cuda",
        dtype=dtype,
        cuda_graphs=graphs,
    )
    loaded = load_model(str(path), torch.device("cuda"), getattr(torch, dtype))
    return EngineCore(config, loaded, role=DecodeSettings())


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> float:
    """Tokens before each request's first difference, over all tokens."""
    same = total = 0
    for rid, want in b.items():
        got = a.get(rid, [])
        n = next((k for k, (x, y) in enumerate(zip(got, want, strict=False)) if x != y), None)
        same += min(len(got), len(want)) if n is None else n
        total += len(want)
    return same / total


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_change_no_token(dtype: str, checkpoint: Callable[..., Path]) -> None:
    """fp32: token-exact. bf16: a graph step runs padded (differently shaped) GEMMs and one
    attention group where eager may use several, so its last bits may differ and a near-tie may
    flip; the agreement is reported, and a broken graph (garbage from the first step) fails."""
    path = checkpoint("llama")
    prompts = random_prompts(13, 512, min_len=1, max_len=200, seed=80)
    max_tokens = random_max_tokens(13, lo=4, hi=40, seed=81)
    params = [
        SamplingParams(max_tokens=m, temperature=0.0 if i % 3 else 0.9, top_p=0.9, seed=i)
        for i, m in enumerate(max_tokens)
    ]
    results, cores = {}, {}
    for graphs in (False, True):
        core = cuda_engine(path, dtype, graphs, max_batch_size=16)
        results[graphs], cores[graphs] = run(core, prompts, params), core
    if dtype == "float32":
        assert results[True] == results[False]
    else:
        share = agreement(results[True], results[False])
        record("bf16 tokens identical with CUDA graphs on vs off (before divergence)", share)
        assert share >= 0.5, f"CUDA graphs agree with eager on only {share:.0%} of bf16 tokens"
    runner = cores[True].decode_runner
    assert runner is not None and runner.num_replays > 0 and runner.num_captures > 0
    record(f"CUDA graph shapes captured ({dtype})", len(runner.captured_shapes))
    eager_pool, graph_pool = cores[False].kv_pool, cores[True].kv_pool
    assert graph_pool.shape[2] == NUM_BLOCKS + 1 and eager_pool.shape[2] == NUM_BLOCKS
    assert graph_pool[:, :, NUM_BLOCKS].abs().sum() > 0  # the dummies wrote their scratch block
    # same tokens, so the same K/V up to the rounding of differently shaped (padded) GEMMs
    atol = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(graph_pool[:, :, :NUM_BLOCKS], eager_pool, rtol=0, atol=atol)
    for core in cores.values():
        core.check_conservation()
        assert core.shutdown()


def test_image_requests_replay_graphs_with_their_delta(tmp_path: Path) -> None:
    """A Qwen2-VL engine on the GPU, fp32, graphs on vs off: image and text requests batched
    give the same tokens, and their decode steps replay captured graphs (each row's rope turned
    by its request's mRoPE delta, an input of the graph). The CPU twin of the padded batch is
    tests/test_qwen2_vl_engine.py::test_image_decode_steps_take_the_graph_path."""
    from tests.support.vision_checkpoints import (
        QWEN2_VL,
        build_vl_checkpoint,
        image_prompt,
        random_image,
    )

    path = build_vl_checkpoint(tmp_path, QWEN2_VL)
    # (text parts around the images, image grids): a text prompt, one image, two images
    cases = [
        ([[1, 2, 3, 4, 5]], []),
        ([[10, 11], [12]], [(1, 4, 6)]),
        ([[20], [21], [22]], [(1, 8, 4), (1, 2, 2)]),
    ]
    images = [
        [random_image(grid, seed=10 * i + j) for j, grid in enumerate(grids)]
        for i, (_, grids) in enumerate(cases)
    ]
    prompts = [image_prompt(texts, im) for (texts, _), im in zip(cases, images, strict=True)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results, runners = {}, {}
    for graphs in (False, True):
        core = cuda_engine(path, "float32", graphs, max_batch_size=4)
        requests = [
            core.add_request(p, params, request_id=f"v{i}", images=im)
            for i, (p, im) in enumerate(zip(prompts, images, strict=True))
        ]
        while core.has_work:
            core.step()
        results[graphs] = [list(r.output_token_ids) for r in requests]
        runners[graphs] = core.decode_runner
        core.check_conservation()
        assert core.shutdown()
    assert results[True] == results[False]
    runner = runners[True]
    assert runner is not None and runner.num_replays > 0
    record("Qwen2-VL decode steps replayed as CUDA graphs", runner.num_replays)
