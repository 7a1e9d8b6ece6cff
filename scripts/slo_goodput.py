"""SLO-aware admission's goodput against a real `pdserve up` (1 prefill + 1 decode node):

  python scripts/slo_goodput.py [--model smollm2] [--requests 40] [--ttft-slo-ms 2000]

1. capacity C: closed loop, `--concurrency` clients back to back for `--seconds`, no target;
2. open-loop Poisson arrivals at C and at 2C, `--requests` each, admission off (no target on
   the request) then on (`ttft_slo_ms` on every request, as a client sets it): per run, the
   requests served within the target (good), refused (429, with their Retry-After), late, TTFT
   p50 / p90 of those served, and goodput = good / the run's wall time.

~500-token prompts of random words (no two share a prefix), 32 output tokens, streamed over
HTTP. Prints one JSON object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

# one common English word is one token for most tokenizers
WORDS = re.findall(
    r"\w+",
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point company number group problem fact river mountain ocean city road garden music "
    "story letter window table market bridge forest island engine paper",
)


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    text: str,
    slo_ms: float | None,
    out: list[dict],
) -> None:
    body: dict[str, Any] = {"model": model, "prompt": text, "max_tokens": 32, "stream": True}
    body["ignore_eos"] = True
    if slo_ms is not None:
        body["ttft_slo_ms"] = slo_ms
    start, ttft = time.monotonic(), None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            out.append({"status": r.status_code, "retry_after": r.headers.get("retry-after")})
            return
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: ") and '"text"' in line:
                ttft = time.monotonic() - start
    out.append({"status": 200, "ttft": ttft})


async def closed_loop(url: str, model: str, a: argparse.Namespace, rng: random.Random) -> float:
    out: list[dict] = []
    end = time.monotonic() + a.seconds
    async with httpx.AsyncClient(timeout=300) as client:

        async def worker() -> None:
            while time.monotonic() < end:
                await one(client, url, model, prompt(rng, a.prompt_words), None, out)

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(a.concurrency)))
        return sum(r["status"] == 200 for r in out) / (time.monotonic() - start)


async def open_loop(
    url: str,
    model: str,
    rate: float,
    slo_ms: float | None,
    a: argparse.Namespace,
    rng: random.Random,
) -> dict[str, Any]:
    offsets, t = [], 0.0
    for _ in range(a.requests):
        t += rng.expovariate(rate)
        offsets.append(t)
    out: list[dict] = []
    async with httpx.AsyncClient(timeout=300) as client:
        start = time.monotonic()

        async def fire(at: float, text: str) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            await one(client, url, model, text, slo_ms, out)

        await asyncio.gather(*(fire(at, prompt(rng, a.prompt_words)) for at in offsets))
        wall = time.monotonic() - start
    target = a.ttft_slo_ms / 1000
    served = sorted(r["ttft"] for r in out if r["status"] == 200 and r["ttft"] is not None)
    good = sum(ttft <= target for ttft in served)
    return {
        "rate": rate,
        "admission": "on" if slo_ms is not None else "off",
        "good": good,
        "late": len(served) - good,
        "refused": sum(r["status"] == 429 for r in out),
        "retry_after": sorted({r["retry_after"] for r in out if r["status"] == 429}),
        "goodput": good / wall,
        "ttft_p50_s": served[len(served) // 2] if served else None,
        "ttft_p90_s": served[int(len(served) * 0.9)] if served else None,
    }


def start_up(model: str) -> tuple[subprocess.Popen[str], str]:
    up = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--model", model],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert up.stdout is not None
    url = None
    for line in up.stdout:
        found = re.search(r"HTTP \(OpenAI API\): (http://\S+)/v1", line)
        url = found.group(1) if found else url
        if line.startswith("try:"):
            break
    if url is None:
        up.kill()
        raise SystemExit("pdserve up did not start")
    return up, url


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=40, help="per open-loop run")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--prompt-words", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    p.add_argument("--seconds", type=float, default=40.0, help="closed-loop measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_out/slo_goodput.json"))
    a = p.parse_args()
    rng = random.Random(a.seed)
    up, url = start_up(a.model)
    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        warm = argparse.Namespace(**{**vars(a), "seconds": 10.0, "concurrency": 4})
        asyncio.run(closed_loop(url, model, warm, rng))
        capacity = asyncio.run(closed_loop(url, model, a, rng))
        print(f"closed-loop capacity C = {capacity:.2f} req/s", file=sys.stderr, flush=True)
        if capacity <= 0:
            raise SystemExit("no request was served in the closed loop")
        runs = []
        for rate in (capacity, 2 * capacity):
            for slo_ms in (None, a.ttft_slo_ms):
                runs.append(asyncio.run(open_loop(url, model, rate, slo_ms, a, rng)))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
                time.sleep(3)  # the queue drains between runs
    finally:
        up.terminate()
        up.wait(60)
    result = {"model": a.model, "ttft_slo_ms": a.ttft_slo_ms, "capacity": capacity, "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
