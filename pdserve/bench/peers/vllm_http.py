"""The OpenAI-HTTP client side of `pdserve bench peer` that `vllm bench serve` does not cover:
TTFT against prompt length, and decode ITL while long prompts arrive (the interference scenario
of `pdserve bench serve`), both through pdserve/bench/support/load.py's HTTP client so that vLLM
and pdserve get the same client.

Prompts are token-id lists (both servers accept them in /v1/completions), fresh random ids per
request (3.. skip the special tokens) so that no prefix cache helps; every request streams with
`ignore_eos`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.bench.support.load import RequestRecord, RequestSpec, run_requests
from pdserve.bench.support.util import summarize


def random_prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(x) for x in rng.integers(3, vocab, size=n)]


def run(url: str, specs: list[RequestSpec]) -> tuple[list[RequestRecord], float]:
    return asyncio.run(run_requests(url, specs))


def ttft_sweep(
    url: str, lengths: list[int], repeats: int, vocab: int, seed: int
) -> list[dict[str, Any]]:
    """TTFT (one request at a time, 2 output tokens) at each prompt length."""
    rng = np.random.default_rng(seed)
    run(url, [RequestSpec(random_prompt(rng, 32, vocab), 2)])  # warm-up
    rows = []
    for n in lengths:
        records = [
            run(url, [RequestSpec(random_prompt(rng, n, vocab), 2)])[0][0] for _ in range(repeats)
        ]
        stats = summarize([r.ttft * 1000 for r in records if r.ok])
        errors = [r.error or "no token chunk" for r in records if not r.ok]
        row = {"prompt_tokens": n, "ttft_ms_p50": stats["p50"], "ttft_ms": stats}
        rows.append({**row, "errors": errors} if errors else row)
    return rows


@dataclass(frozen=True)
class Interference:
    decode_streams: int = 4
    decode_input_len: int = 32
    decode_output_len: int = 128
    long_prompts: int = 4
    long_input_len: int = 2048


def interference(url: str, cfg: Interference, vocab: int) -> dict[str, Any]:
    """Decode ITL alone, then with long prompts arriving inside the first 60% of the decode
    streams' quiet lifetime (fresh prompts both times)."""
    rng = np.random.default_rng(7)

    def decodes() -> list[RequestSpec]:
        n, length = cfg.decode_input_len, cfg.decode_output_len
        return [
            RequestSpec(random_prompt(rng, n, vocab), length) for _ in range(cfg.decode_streams)
        ]

    quiet, quiet_s = run(url, decodes())
    offsets = sorted(rng.uniform(0.05 * quiet_s, 0.6 * quiet_s, size=cfg.long_prompts))
    prompts = [random_prompt(rng, cfg.long_input_len, vocab) for _ in offsets]
    longs = [RequestSpec(p, 4, float(t), "long") for p, t in zip(prompts, offsets, strict=True)]
    mixed, mixed_s = run(url, decodes() + longs)
    errors = [r.error or "no token chunk" for r in quiet + mixed if not r.ok]
    if errors:
        raise RuntimeError(f"interference run against {url}: {len(errors)} failed: {errors[0]}")

    def ms(samples: list[float]) -> dict[str, float]:
        return summarize([s * 1000 for s in samples])

    def itls(records: list[RequestRecord]) -> list[float]:
        return [g for r in records if r.spec.group == "main" for g in r.itls]

    return {
        "config": cfg.__dict__,
        "decode_itl_alone_ms": ms(itls(quiet)),
        "decode_itl_with_long_prompts_ms": ms(itls(mixed)),
        "long_prompt_ttft_ms": ms([r.ttft for r in mixed if r.spec.group == "long"]),
        "durations_s": {"alone": quiet_s, "with_long_prompts": mixed_s},
    }
