"""What a resumed stream costs its client: `pdserve up --decode 2` (SmolLM2 by default), six
concurrent seeded streams through the front door, run undisturbed and then with the busiest
decode node SIGKILLed mid-stream; prints, per run, the wall time and each stream's longest
pause between two messages (a resumed stream's pause is the resume).

    python scripts/resume_gap.py [--model smollm2] [--port 56051]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.client import generate_stream
from shared.engine.sampling.sampling_params import SamplingParams
from shared.serving.metrics import parse_prometheus_text

PROMPTS = [
    "The history of the bicycle begins",
    "Write a short poem about the sea.",
    "Three facts about the moon:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The best way to learn a language is",
]


def _node_pid(port: int) -> int:
    """The decode node started on gRPC port `port` (`pdserve up` names it on its command line)."""
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            words = (entry / "cmdline").read_text().split("\0")
            if "decode" in words and "--port" in words:
                last = len(words) - 1 - words[::-1].index("--port")  # argparse takes the last
                if words[last + 1] == str(port):
                    return int(entry.name)
    raise LookupError(f"no decode node on port {port}")


def _busiest(http: str, decodes: list[str]) -> int:
    with urllib.request.urlopen(f"{http}/metrics", timeout=5) as r:
        scrape = parse_prometheus_text(r.read().decode())
    load = {t: scrape[f'pdserve_proxy_backend_inflight{{backend="{t}"}}'] for t in decodes}
    return _node_pid(int(max(load, key=lambda t: load[t]).rpartition(":")[2]))


async def _one(target: str, i: int, started: asyncio.Event) -> float:
    params = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.8, seed=1000 + i)
    last, worst, tokens = time.monotonic(), 0.0, 0
    async with contextlib.aclosing(generate_stream(target, PROMPTS[i], params)) as stream:
        async for msg in stream:
            now = time.monotonic()
            worst, last = (max(worst, now - last) if tokens else 0.0), now
            tokens += len(msg.token_ids)
            if tokens >= 4:
                started.set()
    return worst


async def _run(target: str, kill: tuple[str, list[str]] | None) -> tuple[float, list[float]]:
    t0 = time.monotonic()
    events = [asyncio.Event() for _ in PROMPTS]
    tasks = [asyncio.create_task(_one(target, i, e)) for i, e in enumerate(events)]
    await asyncio.gather(*(e.wait() for e in events))
    if kill is not None:
        os.kill(_busiest(*kill), signal.SIGKILL)
    gaps = await asyncio.gather(*tasks)
    return time.monotonic() - t0, sorted(gaps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--port", type=int, default=56051, help="the front door's; +1, +2: the nodes'")
    a = p.parse_args()
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", a.model, "--decode", "2"]
    cmd += ["--port", str(a.port), "--http-port", str(a.port + 10)]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert up.stdout is not None
        for line in up.stdout:
            if line.startswith("try: "):
                break
        else:
            raise SystemExit("pdserve up did not start")
        door, http = f"127.0.0.1:{a.port}", f"http://127.0.0.1:{a.port + 10}"
        decodes = [f"127.0.0.1:{a.port + 1}", f"127.0.0.1:{a.port + 2}"]
        for name, kill in (("undisturbed", None), ("node killed", (http, decodes))):
            wall, gaps = asyncio.run(_run(door, kill))
            print(
                f"{name}: {wall:.2f} s; longest pause per stream (s): "
                + " ".join(f"{g:.2f}" for g in gaps)
            )
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
