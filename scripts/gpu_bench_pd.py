"""P/D part of the GPU benchmark: one prefill and two decode processes on the GPU (layer-wise and
whole-request push), one request at a time; TTFT broken down by the nodes' Timing, and KV push
GB/s = KV bytes / transfer time of the whole-request push (it starts after the last layer)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

from gpu_bench_models import DEVICE, Budget, kv_bytes_per_token, prompt_ids

PROMPT_LENGTHS = [128, 1024, 4096]
REPS = [3]  # a list: --smoke sets it in place


def pd_nodes(path: Path) -> tuple[list[Any], dict[str, str]]:
    from pdserve.cluster import spawn, wait_ready

    engine = [
        "--model",
        str(path),
        "--port",
        "0",
        "--device",
        DEVICE["name"],
        "--dtype",
        DEVICE["dtype"],
        "--num-kv-blocks",
        "1024",
        "--max-num-tokens",
        "8192",
    ]
    prefill = spawn("prefill", engine, echo=False)
    wait_ready([prefill], 180)
    # the benchmark speaks gRPC: two decode nodes on HTTP's default port would collide
    target = ["--prefill", f"127.0.0.1:{prefill.info['port']}", "--http-port", "-1"]
    # every prompt goes to the prefill node: a decode node prefills short ones itself otherwise,
    # and then nothing is pushed and TTFT has no transfer in it
    target += ["--local-prefill-tokens", "0", "--local-prefill-idle-tokens", "0"]
    layerwise = spawn("decode", [*engine, *target], echo=False)
    whole = spawn("decode", [*engine, *target, "--whole-request-push"], echo=False)
    nodes = [prefill, layerwise, whole]
    wait_ready(nodes, 180)
    return nodes, {
        m: f"127.0.0.1:{n.info['port']}" for m, n in (("layerwise", layerwise), ("whole", whole))
    }


def pd_section(name: str, path: Path, budget: Budget) -> dict[str, Any]:
    from pdserve.client import generate
    from pdserve.cluster import stop_all

    nodes, targets = pd_nodes(path)
    rng = random.Random(7)
    rows: list[dict[str, Any]] = []

    async def body() -> None:
        for n in [16, *PROMPT_LENGTHS]:  # 16: warm-up, not reported
            for rep in range(REPS[0] if n != 16 else 1):
                for mode, target in targets.items():
                    if budget.left() < 20:
                        return
                    prompt = prompt_ids(rng, n, name)
                    t0 = time.monotonic()
                    r = await generate(target, prompt, max_tokens=2, ignore_eos=True, timeout=120)
                    if n == 16:
                        continue
                    t = r.timing
                    rows.append(
                        {
                            "mode": mode,
                            "tokens": n,
                            "rep": rep,
                            "client_ttft": time.monotonic() - t0,
                            "ttft": t.time_to_first_token_seconds,
                            "queue": t.queue_seconds,
                            "prefill": t.prefill_seconds,
                            "tail": t.kv_transfer_seconds,
                        }
                    )

    try:
        asyncio.run(body())
    finally:
        stop_all(nodes)
    return {"model": name, "kv_bytes_per_token": kv_bytes_per_token(name), "requests": rows}


def pd_summary(result: dict[str, Any], perftest: float | None) -> list[list[str]]:
    out, name, per_token = [], result["model"], result["kv_bytes_per_token"]
    for n in PROMPT_LENGTHS:
        lw = [r for r in result["requests"] if r["tokens"] == n and r["mode"] == "layerwise"]
        wh = [r for r in result["requests"] if r["tokens"] == n and r["mode"] == "whole"]
        if lw:
            med = {
                k: statistics.median(r[k] for r in lw) for k in ("ttft", "queue", "prefill", "tail")
            }
            other = med["ttft"] - med["queue"] - med["prefill"] - med["tail"]
            ratio = med["tail"] / med["prefill"] if med["prefill"] else float("inf")
            ok = "" if n < 1024 else ("ok" if ratio <= 0.10 else "FAIL")
            out.append(
                [
                    f"TTFT {name} {n} tok (layer-wise): ttft/queue/prefill/tail/other ms",
                    "/".join(f"{v * 1e3:.1f}" for v in (*med.values(), other)),
                    f"tail/prefill {ratio:.2f} (<= 0.10 for >= 1k)",
                    ok,
                ]
            )
        if wh:
            tail = statistics.median(r["tail"] for r in wh)
            payload = n * per_token
            gbs = payload / tail / 1e9 if tail > 0 else float("inf")
            target, ok = "", ""
            if perftest and payload >= 16 * 2**20:
                target, ok = (
                    f">= 0.8x perftest: {gbs / perftest:.2f}x",
                    ("ok" if gbs >= 0.8 * perftest else "FAIL"),
                )
            out.append(
                [
                    f"KV push {name} {n} tok ({payload / 2**20:.0f} MiB), GB/s",
                    f"{gbs:.1f}",
                    target,
                    ok,
                ]
            )
    return out
