"""Qwen3, Gemma 2, Gemma 3 and Phi-3 against transformers: prefill logits, greedy generation
through `LLM` (chunked prefill, prefix-cache hits, windows shorter than the prompts), and the
engine's sampling features (penalties, logprobs, n > 1) on every family.

Tiny random checkpoints built with transformers from a config (tests/support/
checkpoints.py), each variant exercising what its family changes: head_dim != hidden / heads,
GQA and MQA, tied and untied embeddings, several sliding / global layer patterns, score and
logit soft-capping, per-layer rope bases and partial rotary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.kv.pool import allocate_kv_pool
from shared.model.forward_batch import ForwardBatch, SeqEntry
from shared.model.loader import load_model
from tests.engine_helpers import (
    hf_greedy,
    random_max_tokens,
    random_prompts,
    single_torch_thread,
)
from tests.support.checkpoints import load_hf_model

VOCAB = 512
WINDOW = 24  # shorter than the longer prompts and than two prefill chunks
CHUNK = 48  # the engine's per-step token budget: the longer prompts take several chunks
SLIDING, FULL = "sliding_attention", "full_attention"

VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "qwen3-gqa-untied": ("qwen3", {"head_dim": 32, "tie_word_embeddings": False}),
    "qwen3-mqa-tied-window": (
        "qwen3",
        {
            "head_dim": 24,
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
        },
    ),
    "gemma2-softcap": (
        "gemma2",
        {
            "num_hidden_layers": 3,  # the default pattern: sliding, global, sliding
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 8.0,
            "final_logit_softcapping": 12.0,
        },
    ),
    "gemma3-mqa-untied": (
        "gemma3",
        {
            "num_hidden_layers": 4,
            "layer_types": [SLIDING, FULL, SLIDING, SLIDING],
            "num_key_value_heads": 1,
            "head_dim": 32,
            "sliding_window": WINDOW,
            "tie_word_embeddings": False,
            "final_logit_softcapping": 15.0,
            "rope_parameters": {
                FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            },
        },
    ),
    "gemma3-global-first": (
        "gemma3",
        {
            "num_hidden_layers": 2,
            "layer_types": [FULL, SLIDING],
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": WINDOW,
        },
    ),
    "phi3-partial-rotary-window": (
        "phi3",
        {"partial_rotary_factor": 0.5, "sliding_window": WINDOW, "num_hidden_layers": 3},
    ),
    "phi3-mqa-tied": ("phi3", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
}


def family_prompts(seed: int) -> list[list[int]]:
    """14 prompts: short ones, ones longer than the window and than one prefill chunk, and
    four sharing a 40-token prefix (the later ones hit the prefix cache)."""
    mixed = random_prompts(10, VOCAB, min_len=1, max_len=130, seed=seed)
    mixed[0] = random_prompts(1, VOCAB, min_len=110, max_len=130, seed=seed + 1)[0]
    system = random_prompts(1, VOCAB, min_len=40, max_len=40, seed=seed + 2)[0]
    shared = random_prompts(4, VOCAB, min_len=1, max_len=20, seed=seed + 3, prefix=system)
    return mixed + shared


def engine_config(path: Path) -> EngineConfig:
    return EngineConfig(
        model=str(path), num_kv_blocks=512, max_batch_size=8, max_num_tokens=CHUNK, block_size=8
    )


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_logits_match_transformers(name: str, variant: Callable[[str], Path]) -> None:
    """A batch of fresh prompts, then a continuation over cached blocks (a prefix hit), give
    transformers' logits for every token."""
    path = variant(name)
    loaded, hf = load_model(str(path), dtype=torch.float32), load_hf_model(path)
    block = 4
    pool = allocate_kv_pool(loaded.config.kv_layout(block, torch.float32), 128, "cpu")
    seqs = random_prompts(3, VOCAB, min_len=5, max_len=60, seed=len(name))
    seqs[0] = random_prompts(1, VOCAB, min_len=60, max_len=60, seed=1)[0]
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(len(seqs))]
    with single_torch_thread():
        entries = [SeqEntry(s, 0, t) for s, t in zip(seqs, tables, strict=True)]
        fresh = loaded.model(ForwardBatch.build(entries, block, "cpu"), pool, all_logits=True)
        # a prompt sharing seqs[0]'s first 32 tokens (8 blocks) computes only its own tail
        tail = random_prompts(1, VOCAB, min_len=20, max_len=20, seed=2)[0]
        cont = SeqEntry(tail, 32, tables[0][:8] + list(range(100, 112)))
        continued = loaded.model(ForwardBatch.build([cont], block, "cpu"), pool, all_logits=True)
        expected = torch.cat([hf_logits(hf, s) for s in seqs])
        expected_tail = hf_logits(hf, seqs[0][:32] + tail)[32:]
    torch.testing.assert_close(fresh, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(continued, expected_tail, atol=1e-4, rtol=0)


def greedy_matches_transformers(
    path: Path, name: str, explain: Callable[[Path, list[int]], str] | None = None
) -> None:
    """14 prompts through `LLM` (some over several prefill chunks, the last three sharing the
    11th's prefix, cached once it is done): every greedy token equals transformers' `generate`.
    `explain(path, ids)`: what to add to a mismatch's message (a MoE router's nearest tie)."""
    prompts = family_prompts(seed=sum(map(ord, name)))
    max_tokens = random_max_tokens(len(prompts), lo=1, hi=12, seed=len(name))
    params = [SamplingParams(max_tokens=m) for m in max_tokens]
    with single_torch_thread():
        engine = LLM(engine_config(path), load_model(str(path), dtype=torch.float32))
        outputs = engine.generate(prompts[:11], params[:11])
        hits = engine.generate(prompts[11:], params[11:])
        for prompt, m, out in zip(prompts, max_tokens, outputs + hits, strict=True):
            want = hf_greedy(path, prompt, m)
            if out.token_ids != want:
                why = explain(path, prompt + want) if explain else ""
                pytest.fail(f"prompt of {len(prompt)}: {out.token_ids} != {want}; {why}")
    assert any(len(p) > 2 * CHUNK for p in prompts)
    assert all(out.cached_tokens >= 40 for out in hits)
    engine.check_conservation()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_generation_matches_transformers(name: str, variant: Callable[[str], Path]) -> None:
    greedy_matches_transformers(variant(name), name)


@pytest.mark.parametrize(
    "name",
    ["qwen3-gqa-untied", "gemma2-softcap", "gemma3-mqa-untied", "phi3-partial-rotary-window"],
)
def test_sampling_features_on_every_family(name: str, variant: Callable[[str], Path]) -> None:
    """Repetition penalty (token-exact with transformers), logprobs (transformers' log-softmax
    of the chosen tokens) and n = 2 greedy completions (both equal) on the family's model."""
    path = variant(name)
    prompts = random_prompts(3, VOCAB, min_len=30, max_len=80, seed=9)
    hf = load_hf_model(path)
    with single_torch_thread():
        engine = LLM(engine_config(path), load_model(str(path), dtype=torch.float32))
        penalised = engine.generate(prompts, SamplingParams(max_tokens=8, repetition_penalty=1.5))
        for prompt, out in zip(prompts, penalised, strict=True):
            assert out.token_ids == hf_greedy(path, prompt, 8, repetition_penalty=1.5)
        [first, second] = engine.generate([prompts[0]], SamplingParams(max_tokens=6, n=2))
        assert first.token_ids == second.token_ids == hf_greedy(path, prompts[0], 6)
        [scored] = engine.generate([prompts[1]], SamplingParams(max_tokens=5, logprobs=2))
        full = prompts[1] + scored.token_ids
        expected = torch.log_softmax(hf_logits(hf, full), dim=-1)
    assert scored.logprobs is not None and len(scored.logprobs) == len(scored.token_ids)
    for i, entry in enumerate(scored.logprobs):
        want = expected[len(prompts[1]) - 1 + i, entry.token_id].item()
        assert math.isclose(entry.logprob, want, abs_tol=1e-3)
        assert len(entry.top) >= 2
    engine.check_conservation()
