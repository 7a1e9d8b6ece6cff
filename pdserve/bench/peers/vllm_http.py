"""The OpenAI-HTTP client side of `pdserve bench peer` that `vllm bench serve` does not cover:
TTFT against prompt length, and decode ITL while long prompts arrive (the interference scenario
of `pdserve bench serve`, over HTTP so that vLLM and pdserve get the same client).

Prompts are token-id lists (both servers accept them in /v1/completions), fresh random ids per
request so that no prefix cache helps; every request streams with `ignore_eos`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from pdserve.bench.support.util import summarize

TIMEOUT_S = 600.0


@dataclass
class Stream:
    prompt: list[int]
    max_tokens: int
    delay_s: float = 0.0
    group: str = ""
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def random_prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(x) for x in rng.integers(3, vocab, size=n)]


async def stream(client: httpx.AsyncClient, url: str, model: str, s: Stream) -> Stream:
    """POST /v1/completions (stream); one timestamp per SSE chunk that carries a token."""
    await asyncio.sleep(s.delay_s)
    body = {
        "model": model,
        "prompt": s.prompt,
        "max_tokens": s.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    s.start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                s.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return s
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if json.loads(line[6:]).get("choices"):
                    s.chunk_times.append(time.perf_counter())
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"
    if s.error is None and not s.chunk_times:
        s.error = "no token chunk"
    return s


async def run_streams(url: str, model: str, streams: list[Stream]) -> tuple[list[Stream], float]:
    limits = httpx.Limits(max_connections=len(streams) + 4)
    async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits) as client:
        started = time.perf_counter()
        done = await asyncio.gather(*(stream(client, url, model, s) for s in streams))
        return list(done), time.perf_counter() - started


def ttft_sweep(
    url: str, model: str, lengths: list[int], repeats: int, vocab: int, seed: int
) -> list[dict[str, Any]]:
    """TTFT (one request at a time, 2 output tokens) at each prompt length."""
    rng = np.random.default_rng(seed)
    asyncio.run(run_streams(url, model, [Stream(random_prompt(rng, 32, vocab), 2)]))  # warm-up
    rows = []
    for n in lengths:
        samples: list[float] = []
        errors: list[str] = []
        for _ in range(repeats):
            (s,), _ = asyncio.run(
                run_streams(url, model, [Stream(random_prompt(rng, n, vocab), 2)])
            )
            if s.error:
                errors.append(s.error)
            else:
                samples.append(s.ttft * 1000)
        stats = summarize(samples)
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


def interference(url: str, model: str, cfg: Interference, vocab: int) -> dict[str, Any]:
    """Decode ITL alone, then with long prompts arriving inside the first 60% of the decode
    streams' quiet lifetime (fresh prompts both times)."""
    rng = np.random.default_rng(7)

    def decodes() -> list[Stream]:
        return [
            Stream(random_prompt(rng, cfg.decode_input_len, vocab), cfg.decode_output_len, 0, "d")
            for _ in range(cfg.decode_streams)
        ]

    quiet, quiet_s = asyncio.run(run_streams(url, model, decodes()))
    offsets = sorted(rng.uniform(0.05 * quiet_s, 0.6 * quiet_s, size=cfg.long_prompts))
    longs = [
        Stream(random_prompt(rng, cfg.long_input_len, vocab), 4, float(t), "long") for t in offsets
    ]
    mixed, mixed_s = asyncio.run(run_streams(url, model, decodes() + longs))
    errors = [s.error for s in quiet + mixed if s.error]
    if errors:
        raise RuntimeError(f"interference run against {url}: {len(errors)} failed: {errors[0]}")

    def itl_ms(streams: list[Stream]) -> dict[str, float]:
        return summarize([g * 1000 for s in streams if s.group == "d" for g in s.itls])

    alone, loaded = itl_ms(quiet), itl_ms(mixed)
    return {
        "config": cfg.__dict__,
        "decode_itl_alone_ms": alone,
        "decode_itl_with_long_prompts_ms": loaded,
        "long_prompt_ttft_ms": summarize([s.ttft * 1000 for s in mixed if s.group == "long"]),
        "durations_s": {"alone": quiet_s, "with_long_prompts": mixed_s},
    }
