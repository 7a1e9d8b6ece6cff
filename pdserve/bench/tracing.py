"""What OpenTelemetry tracing costs a request: TTFT and decode tokens/s, tracing on vs off.

Two identical P/D pairs run side by side (prefill node on core 0, decode node on core 1, one
torch thread each, `--local-prefill-tokens 0` so every prompt takes the traced remote path):
one exports its spans over OTLP/HTTP to a receiver in this process, the other has no endpoint
(tracing off). Requests go one at a time, alternating between the pairs (order rotating per
repeat), every prompt distinct. Per mode: TTFT p50 and decode tokens/s p50 (1 / time per output
token after the first); headlines: on / off for both, the TTFT one also paired per repeat (a slow
spell of the shared machine falls on both requests of a repeat) — and, steadier on a shared
machine than any latency, the CPU milliseconds each node spent per request. The receiver runs in
its own process; the spans it received are counted, to show that the traced pair exported one
trace per request and the other nothing.

    python -m pdserve.bench.tracing [--quick] [--tokens 256] [--output 32] [--out bench_out]
    pdserve bench tracing ...
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from pdserve.bench.support import nodes as bench_nodes
from pdserve.bench.support.load import RequestSpec, random_prompts, stream_request
from pdserve.bench.support.models import resolve
from pdserve.bench.support.util import (
    child_env,
    environment,
    exit_on_sigterm,
    kill_group,
    load_average,
    process_cpu_seconds,
    write_json,
)

MODES = ("off", "on")
TARGET = 0.03  # tracing on costs at most 3% of TTFT p50 and of decode tokens/s


def specs(model: str, endpoint: str) -> list[bench_nodes.NodeSpec]:
    """A P/D pair per mode; only the "on" pair is given the endpoint."""
    out = []
    for mode in MODES:
        extra = ["--otlp-traces-endpoint", endpoint] if mode == "on" else []
        base = [*bench_nodes.engine_args(model), *extra]
        prefill = ["prefill", *base, "--port", "0", "--metrics-port", "-1"]
        decode = ["decode", *base, "--port", "0", "--metrics-port", "-1", "--http-port", "-1"]
        decode += ["--prefill", f"{{port:prefill-{mode}}}", "--local-prefill-tokens", "0"]
        prefill_core, decode_core = bench_nodes.core(0), bench_nodes.core(1)
        out.append(bench_nodes.NodeSpec(f"prefill-{mode}", "pdserve.cli", prefill, prefill_core))
        out.append(bench_nodes.NodeSpec(f"decode-{mode}", "pdserve.cli", decode, decode_core))
    return out


def cpu_seconds(nodes: bench_nodes.RunningNodes) -> dict[str, float]:
    return {name: process_cpu_seconds(n.proc.pid) for name, n in nodes.nodes.items()}


async def measure(
    nodes: bench_nodes.RunningNodes, vocab: int, tokens: int, output: int, reps: int, bar: tqdm
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Per-request samples, and the CPU ms per request each node spent while measured."""
    from pdserve.client import create_channel

    rng = np.random.default_rng(0)
    channels = {mode: create_channel(nodes.target(f"decode-{mode}")) for mode in MODES}
    samples: list[dict[str, Any]] = []
    try:
        for channel in channels.values():  # warm-up: connections, first-call paths
            for prompt in random_prompts(2, tokens, vocab, rng):
                await stream_request(channel, RequestSpec(prompt, output), 600)
        before = cpu_seconds(nodes)
        for rep in range(reps):
            for mode in MODES[rep % 2 :] + MODES[: rep % 2]:
                prompt = random_prompts(1, tokens, vocab, rng)[0]
                record = await stream_request(channels[mode], RequestSpec(prompt, output), 600)
                if not record.ok:
                    raise RuntimeError(f"tracing {mode}: request failed: {record.error}")
                tpot = record.tpot
                samples.append(
                    {
                        "mode": mode,
                        "rep": rep,
                        "ttft_s": record.ttft,
                        "decode_tokens_per_s": 1.0 / tpot if tpot else 0.0,
                    }
                )
                bar.update()
        after = cpu_seconds(nodes)
    finally:
        for channel in channels.values():
            await channel.close()
    return samples, {name: 1e3 * (after[name] - before[name]) / reps for name in after}


def aggregate(samples: list[dict[str, Any]], cpu_ms: dict[str, float]) -> dict[str, Any]:
    modes = {}
    for mode in MODES:
        mine = [s for s in samples if s["mode"] == mode]
        modes[mode] = {
            "ttft_p50_ms": 1e3 * statistics.median(s["ttft_s"] for s in mine),
            "decode_tokens_per_s_p50": statistics.median(s["decode_tokens_per_s"] for s in mine),
            "n": len(mine),
        }
    by_rep: dict[int, dict[str, float]] = {}
    for s in samples:
        by_rep.setdefault(s["rep"], {})[s["mode"]] = s["ttft_s"]
    paired = statistics.median(r["on"] / r["off"] for r in by_rep.values() if len(r) == 2)
    ttft = modes["on"]["ttft_p50_ms"] / modes["off"]["ttft_p50_ms"]
    rate = modes["on"]["decode_tokens_per_s_p50"] / modes["off"]["decode_tokens_per_s_p50"]
    for mode in MODES:
        modes[mode]["cpu_ms_per_request"] = {
            role: cpu_ms[f"{role}-{mode}"] for role in ("prefill", "decode")
        }
    return {
        "modes": modes,
        "ttft_on_over_off": ttft,
        "ttft_on_over_off_paired": paired,
        "decode_rate_on_over_off": rate,
        "targets": {
            "ttft_within_3pct": paired <= 1 + TARGET,
            "decode_rate_within_3pct": rate >= 1 - TARGET,
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats, short outputs (CI)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument("--tokens", type=int, default=256, help="prompt tokens")
    parser.add_argument("--output", type=int, default=0, help="output tokens (0: 16 quick, 64)")
    parser.add_argument("--reps", type=int, default=0, help="0: 10 quick, 100 full")
    a = parser.parse_args(argv)
    exit_on_sigterm()
    output = a.output or (16 if a.quick else 64)
    reps = a.reps or (10 if a.quick else 100)
    model = resolve("tiny", a.out / "models")
    load_at_start = load_average()
    sink = subprocess.Popen(
        [sys.executable, "-m", "pdserve.bench.support.otlp_sink"],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        start_new_session=True,
    )
    try:
        assert sink.stdout is not None
        port = int(sink.stdout.readline().split()[1])
        endpoint = f"http://127.0.0.1:{port}/v1/traces"
        bar = tqdm(total=reps * len(MODES), desc="tracing", unit="req")
        with bench_nodes.running(specs(model.spec, endpoint), a.out / "logs" / "tracing") as n:
            got = asyncio.run(measure(n, model.prompt_vocab, a.tokens, output, reps, bar))
        bar.close()  # the nodes stopped above: every span is flushed by now
        received = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=10).json()
    finally:
        kill_group(sink)
    result = {
        "benchmark": "tracing",
        "environment": environment(),
        "load_average": {"start": load_at_start, "end": load_average()},
        "setup": "two P/D pairs of tiny (prefill core 0, decode core 1, one torch thread), one "
        f"exporting traces to a local OTLP/HTTP receiver; {a.tokens}-token prompts, {output} "
        f"output tokens, one request at a time alternating pairs, {reps} repeats",
        **aggregate(*got),
        "spans_received": received["spans"],
        "traces_received": received["decode_traces"],
        "requests_traced": 2 + reps,  # the "on" pair's warm-up and measured requests
        "samples": got[0],
    }
    write_json(a.out / "tracing.json", result)
    on, off = result["modes"]["on"], result["modes"]["off"]
    print(
        f"TTFT p50 {off['ttft_p50_ms']:.2f} ms off, {on['ttft_p50_ms']:.2f} ms on "
        f"(x{result['ttft_on_over_off_paired']:.3f} paired); decode "
        f"{off['decode_tokens_per_s_p50']:.1f} tok/s off, {on['decode_tokens_per_s_p50']:.1f} on "
        f"(x{result['decode_rate_on_over_off']:.3f}); CPU ms/request off "
        f"{off['cpu_ms_per_request']}, on {on['cpu_ms_per_request']}; "
        f"load {result['load_average']}"
    )
    return result


if __name__ == "__main__":
    main()
