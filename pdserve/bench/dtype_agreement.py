"""bf16 against fp32 on the same prompts: how many greedy outputs stay identical, and where the
rest first differ (the roofline benchmark reports it beside each dtype's speed)."""

from __future__ import annotations

from typing import Any

from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import LoadedModel

AGREEMENT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
    "Translate 'good morning' into Spanish:",
    "The quick brown fox",
]


def greedy_tokens(loaded: LoadedModel, dtype: str, prompts: int, tokens: int) -> list[list[int]]:
    """Greedy outputs of the first `prompts` fixed prompts, `tokens` each, through the engine."""
    ids = [loaded.tokenizer.encode(p) for p in AGREEMENT_PROMPTS[:prompts]]
    config = EngineConfig(model=loaded.name, num_kv_blocks=512, device="cpu", dtype=dtype)
    llm = LLM(config, loaded)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    outputs = llm.generate(ids, params)
    llm.check_conservation()
    return [o.token_ids for o in outputs]


def agreement(fp32: list[list[int]], bf16: list[list[int]]) -> dict[str, Any]:
    """Share of greedy outputs identical in bf16 and fp32; where each first differs."""
    first = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        for a, b in zip(fp32, bf16, strict=True)
    ]
    diverged = [f for f in first if f is not None]
    return {
        "prompts": len(first),
        "tokens_per_prompt": len(fp32[0]) if fp32 else 0,
        "share_identical": first.count(None) / max(1, len(first)),
        "first_divergence": first,
        "mean_first_divergence": sum(diverged) / len(diverged) if diverged else None,
    }
