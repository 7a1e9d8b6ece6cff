"""Grammar compilation under pressure, against a real `pdserve up` (1 prefill + 1 decode):

  python scripts/grammar_pressure.py [--model smollm2] [--slow 8] [--large 20]

1. quiet: an unconstrained 150-token greedy stream, timed (the faster of two), once one
   trivial schema has compiled (the node starts its compile workers in the background);
2. slow: `--slow` schemas that take far longer than the compile limit to compile (1,500
   optional properties), sent at once beside the same unconstrained stream: each schema's status
   and time, the stream's time, the decode node's RSS before and after;
3. large: `--large` distinct ~120 KB enum schemas (4,000 values inside an object, tens of MB
   compiled each), one after another: the decode node's RSS after each.

Prints one JSON object. Needs xgrammar (`pip install 'pdserve[structured]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def start_up(model: str) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", model, "--port", "0"]
    up = subprocess.Popen([*cmd, "--http-port", "0"], stdout=subprocess.PIPE, text=True)
    assert up.stdout is not None
    for line in up.stdout:
        if line.startswith("HTTP (OpenAI API): "):
            return up, line.split()[3].removesuffix("/v1")
    raise SystemExit(f"pdserve up exited with {up.wait()}")


def decode_pid(up: subprocess.Popen[str]) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            argv = (entry / "cmdline").read_text().split("\0")
        except OSError:
            continue
        ppid = next(int(line.split()[1]) for line in status.splitlines() if line[:5] == "PPid:")
        if ppid == up.pid and "decode" in argv:
            return int(entry.name)
    raise SystemExit("no decode node found")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def slow_schema(tag: int, properties: int = 1500) -> dict[str, Any]:
    props = {f"p{tag}_{i}": {"type": "string"} for i in range(properties)}
    return {"type": "object", "properties": props}


def large_schema(tag: int) -> dict[str, Any]:
    values = [f"value-{tag}-{i:06d}-xxxxxxxx" for i in range(4000)]
    return {"type": "object", "properties": {"a": {"enum": values}}, "required": ["a"]}


def fmt(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


async def timed(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, float, str]:
    start = time.monotonic()
    r = await client.post("/v1/completions", json=body)
    return r.status_code, time.monotonic() - start, r.text[:200]


async def run(base: str, model: str, pid: int, a: argparse.Namespace) -> dict[str, Any]:
    stream = {"model": model, "prompt": "Count:", "max_tokens": 150, "temperature": 0}
    stream["ignore_eos"] = True
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await timed(client, {**stream, "max_tokens": 4})  # warm
        # a node starts its compile workers in the background: steady state once one answers
        trivial = {"model": model, "prompt": "x", "max_tokens": 2}
        trivial["response_format"] = fmt({"type": "integer"})  # ignore_eos with one is a 400
        status, _, text = await timed(client, trivial)
        assert status == 200, text
        out["quiet_stream_s"] = min([(await timed(client, stream))[1] for _ in range(2)])
        out["rss_before_mb"] = rss_mb(pid)
        # the control: the same 8 short requests with no grammar, beside the same stream (what
        # sharing the batch costs the stream whatever the requests are)
        plain = {"model": model, "prompt": "x", "max_tokens": 4}
        *_, control = await asyncio.gather(
            *(timed(client, plain) for _ in range(a.slow)), timed(client, stream)
        )
        out["control_stream_s"] = control[1]
        out["rss_after_control_mb"] = rss_mb(pid)
        slow = [
            timed(client, {"model": model, "prompt": "x", "max_tokens": 4, "response_format": f})
            for f in (fmt(slow_schema(i, a.properties)) for i in range(a.slow))
        ]
        *answers, busy = await asyncio.gather(*slow, timed(client, stream))
        out["slow"] = [{"status": s, "seconds": round(t, 2), "body": b} for s, t, b in answers]
        out["busy_stream_s"] = busy[1]
        await asyncio.sleep(2)
        out["rss_after_slow_mb"] = rss_mb(pid)
        large = []
        for i in range(a.large):
            body = {"model": model, "prompt": "x", "max_tokens": 1}
            body["response_format"] = fmt(large_schema(i))
            status, seconds, _ = await timed(client, body)
            large.append({"status": status, "seconds": round(seconds, 2), "rss_mb": rss_mb(pid)})
        out["large"] = large
    out["rss_growth_large_mb"] = large[-1]["rss_mb"] - out["rss_after_slow_mb"] if large else 0
    out["stream_ratio"] = out["busy_stream_s"] / out["quiet_stream_s"]
    out["control_ratio"] = out["control_stream_s"] / out["quiet_stream_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--slow", type=int, default=8)
    p.add_argument("--large", type=int, default=20)
    p.add_argument("--properties", type=int, default=1500, help="of each slow schema")
    a = p.parse_args()
    up, base = start_up(a.model)
    try:
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        result = asyncio.run(run(base, model, decode_pid(up), a))
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
