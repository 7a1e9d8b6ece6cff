"""Parity with transformers on CUDA: fp32 greedy token-exact (CUDA graphs on and off); bf16
prefill logits close, greedy agreement reported. Skipped without a GPU (`pytest -m cuda`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.forward_batch import ForwardBatch, SeqEntry
from shared.model.loader import load_model
from tests.cuda_facts import CUDA_MARKS, record
from tests.engine_helpers import hf_greedy_with, random_max_tokens, random_prompts
from tests.support.checkpoints import load_hf_model

pytestmark = CUDA_MARKS
CUDA = torch.device("cuda")


def engine(path: Path, dtype: str, graphs: bool = True) -> LLM:
    config = EngineConfig(
        model=str(path), num_kv_blocks=512, device="cuda", dtype=dtype, cuda_graphs=graphs
    )
    return LLM(config, load_model(str(path), CUDA, getattr(torch, dtype)))


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp32_greedy_is_token_exact_with_transformers(
    arch: str, graphs: bool, checkpoint: Callable[..., Path]
) -> None:
    path = checkpoint(arch)
    prompts = random_prompts(12, 512, min_len=1, max_len=150, seed=70)
    max_tokens = random_max_tokens(12, hi=24, seed=71)
    llm = engine(path, "float32", graphs)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    hf = load_hf_model(path).to(CUDA)
    for i, (p, m, o) in enumerate(zip(prompts, max_tokens, outs, strict=True)):
        assert o.token_ids == hf_greedy_with(hf, p, m), f"prompt {i} differs from transformers"
    runner = llm.core.decode_runner
    assert (runner is not None and runner.num_replays > 0) == graphs
    llm.core.check_conservation()


def test_bf16_prefill_logits_close_and_greedy_agreement(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    prompt = random_prompts(1, 512, min_len=96, max_len=96, seed=72)[0]
    llm = engine(path, "bfloat16")
    core = llm.core
    table = list(range(len(prompt) // core.config.block_size + 1))
    batch = ForwardBatch.build([SeqEntry(prompt, 0, table)], core.config.block_size, CUDA)
    ours = core.model.forward(batch, core.kv_pool, all_logits=True)
    hf = load_hf_model(path).to(CUDA, torch.bfloat16)
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt], device=CUDA)).logits[0].float()
    diff = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    record("bf16 prefill max |logit diff| / max |logit|", round(diff / scale, 5))
    assert diff <= 0.05 * scale, f"bf16 prefill logits differ by {diff} (max |logit| {scale})"
    prompts = random_prompts(8, 512, min_len=8, max_len=120, seed=73)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16))
    agree = total = 0
    for p, o in zip(prompts, outs, strict=True):
        want = hf_greedy_with(hf, p, 16)
        pairs = zip(o.token_ids, want, strict=False)
        n = next((k for k, (a, b) in enumerate(pairs) if a != b), None)
        agree += min(len(o.token_ids), len(want)) if n is None else n
        total += len(want)
    record("bf16 greedy tokens agreeing with transformers before divergence", f"{agree}/{total}")
    core.check_conservation()
