"""Load generation and serving metrics, modelled on `vllm bench serve`.

Arrivals: a gamma process with mean rate `request_rate` (burstiness 1 is Poisson; lower is
burstier, higher more regular; an infinite rate sends everything at once), at most
`max_concurrency` requests in flight. Each request is streamed through pdserve's async client
and timed at the client: TTFT (send -> first token), ITL (gaps between streamed chunks), TPOT
((E2E - TTFT) / (output tokens - 1)), E2E. Goodput counts the requests that meet every SLO.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.bench.support.util import summarize


@dataclass
class RequestSpec:
    prompt: list[int]
    max_tokens: int
    arrival: float = 0.0  # seconds after the start of the run
    group: str = "main"  # which population the request belongs to (e.g. "decode", "long")


@dataclass
class RequestRecord:
    spec: RequestSpec
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end: float = 0.0
    error: str | None = None
    timing: dict[str, float] = field(default_factory=dict)  # the server's Timing message

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None


# ---- workload -----------------------------------------------------------------------------------
def arrival_offsets(
    n: int, rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Start offsets of n requests: gamma inter-arrival times with mean 1/rate and shape
    `burstiness` (vllm's definition); rate inf sends all at t=0."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


def random_prompts(
    n: int, length: int, vocab: int, rng: np.random.Generator, prefix_len: int = 0
) -> list[list[int]]:
    """n prompts of `length` random token ids; the first `prefix_len` are shared by all (the
    shared-prefix mode: a common system prompt), the rest differ per prompt."""
    prefix = rng.integers(0, vocab, size=min(prefix_len, length)).tolist()
    return [prefix + rng.integers(0, vocab, size=length - len(prefix)).tolist() for _ in range(n)]


# ---- driver -------------------------------------------------------------------------------------
async def run_requests(
    target: str,
    specs: Sequence[RequestSpec],
    max_concurrency: int | None = None,
    timeout: float = 600.0,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every spec at its arrival offset; returns the records (spec order) and the run's
    wall time (first send to last completion). `target`: HOST:PORT for gRPC Generate, or
    http://HOST:PORT for the OpenAI-compatible /v1/completions (streamed)."""
    import httpx

    from pdserve.client import create_channel

    http = target.startswith(("http://", "https://"))
    limits = httpx.Limits(max_connections=None)
    conn: Any = (
        httpx.AsyncClient(base_url=target, timeout=timeout, limits=limits)
        if http
        else create_channel(target)
    )
    send = stream_request_openai if http else stream_request
    if http:  # the served model's name, asked once, outside every request's timing
        conn.headers["x-pdserve-model"] = (await conn.get("/v1/models")).json()["data"][0]["id"]
    limit = asyncio.Semaphore(max_concurrency or len(specs) or 1)
    started = time.perf_counter()

    async def one(spec: RequestSpec) -> RequestRecord:
        await asyncio.sleep(max(0.0, started + spec.arrival - time.perf_counter()))
        async with limit:
            record = await send(conn, spec, timeout)
        if on_done is not None:
            on_done(record)
        return record

    try:
        records = await asyncio.gather(*(one(s) for s in specs))
    finally:
        await (conn.aclose() if http else conn.close())
    ends = [r.end for r in records if r.end]
    return list(records), (max(ends) if ends else time.perf_counter()) - started


async def warm_up(target: str, vocab: int) -> None:
    """Two concurrent short prompts of fresh tokens (no cache effect) before a measured run:
    the first forwards of every node on the path (and, behind a router, of two nodes) are
    paid here."""
    rng = np.random.default_rng(1234)
    specs = [RequestSpec(p, 4) for p in random_prompts(2, 64, vocab, rng)]
    records, _ = await run_requests(target, specs)
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up against {target} failed: {failed[0]}")


async def stream_request(channel: Any, spec: RequestSpec, timeout: float) -> RequestRecord:
    """One request over an open channel, timed at the client."""
    import grpc

    from pdserve.client import generate_stream

    record = RequestRecord(spec, start=time.perf_counter())
    stream = generate_stream(
        "",
        spec.prompt,
        max_tokens=spec.max_tokens,
        ignore_eos=True,
        timeout=timeout,
        channel=channel,
    )
    try:
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.token_ids:
                    record.chunk_times.append(now)
                    record.chunk_tokens.append(len(chunk.token_ids))
                if chunk.finish_reason:
                    t = chunk.timing
                    record.timing = {
                        "queue": t.queue_seconds,
                        "prefill": t.prefill_seconds,
                        "kv_transfer": t.kv_transfer_seconds,
                        "ttft": t.time_to_first_token_seconds,
                        "e2e": t.e2e_seconds,
                    }
    except grpc.RpcError as e:
        record.error = f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
    record.end = time.perf_counter()
    return record


async def stream_request_openai(client: Any, spec: RequestSpec, timeout: float) -> RequestRecord:
    """The same request through the HTTP API (SSE), timed at the client like the gRPC one: one
    chunk per engine delta; tokens per chunk from the final usage (1 each, the rest on the
    last chunk: a delta holds one token except when stop-string hold-back releases several)."""
    import httpx

    body = {
        "model": client.headers["x-pdserve-model"],  # from /v1/models (run_requests)
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record = RequestRecord(spec, start=time.perf_counter())
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            usage, pending = None, b""
            # raw bytes, not aiter_lines + json per chunk: the client must not be what is timed
            async for data in resp.aiter_raw():
                now = time.perf_counter()
                *events, pending = (pending + data).split(b"\n\n")
                for event in events:
                    if event.startswith(b'data: {"') and b'"choices":[]' not in event:
                        record.chunk_times.append(now)
                        record.chunk_tokens.append(1)
                    elif b'"usage"' in event:
                        usage = json.loads(event[6:])["usage"]
        if usage and record.chunk_tokens:
            record.chunk_tokens[-1] += usage["completion_tokens"] - len(record.chunk_tokens)
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"
    record.end = time.perf_counter()
    return record


# ---- metrics ------------------------------------------------------------------------------------
def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 0.5, 'tpot': 0.05} (SLOs in ms, like vllm)."""
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput SLO {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        slos[key] = float(value) / 1e3
    return slos


def _meets(record: RequestRecord, slos: dict[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2e}
    return all(values[key] <= limit for key, limit in slos.items())


def _ms(samples: list[float]) -> dict[str, float]:
    s = summarize(samples)
    return {
        "mean_ms": s["mean"] * 1e3,
        "median_ms": s["p50"] * 1e3,
        "p99_ms": s["p99"] * 1e3,
        "n": s["n"],
    }


def serving_metrics(
    records: Sequence[RequestRecord], duration: float, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(len(r.spec.prompt) for r in ok)
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft": _ms([r.ttft for r in ok]),
        "tpot": _ms([t for r in ok if (t := r.tpot) is not None]),
        "itl": _ms([gap for r in ok for gap in r.itls]),
        "e2el": _ms([r.e2e for r in ok]),
    }
    if slos:
        good = sum(1 for r in ok if _meets(r, slos))
        metrics["goodput"] = {
            "slos_ms": {k: v * 1e3 for k, v in slos.items()},
            "requests_meeting_slos": good,
            "request_goodput": good / duration if duration else 0.0,
        }
    return metrics
