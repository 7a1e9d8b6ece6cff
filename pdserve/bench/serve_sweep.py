"""Request-rate sweep past saturation (`pdserve bench serve --sweep 4,8,16,inf`).

One P/D pair (prefill on core 0, decode on core 1) with a deliberately small KV pool, the same
random workload at each rate: completed / refused requests, request throughput, goodput under
the SLOs and TTFT p99 against the offered rate. With the admission queue, past saturation the
extra requests wait (TTFT grows with the queue) instead of failing, goodput stays flat, and
only what overflows `--max-queued` is refused (RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from typing import Any

import numpy as np

from pdserve.bench.support import nodes as bench_nodes
from pdserve.bench.support.load import RequestSpec, arrival_offsets, random_prompts, run_requests
from pdserve.bench.support.load import serving_metrics as metrics_of
from pdserve.bench.support.models import BenchModel
from pdserve.bench.support.util import environment, figure, load_average, pyplot, write_json

SWEEP_ENGINE = {"num_kv_blocks": 200, "max_batch_size": 32}  # ~3,200 tokens: saturates early


def parse_rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def workload(a: argparse.Namespace, model: BenchModel, rate: float) -> list[RequestSpec]:
    rng = np.random.default_rng(a.seed)
    prompts = random_prompts(a.num_prompts, a.input_len, model.prompt_vocab, rng)
    offsets = arrival_offsets(a.num_prompts, rate, a.burstiness, rng)
    return [RequestSpec(p, a.output_len, t) for p, t in zip(prompts, offsets, strict=True)]


def pd_sweep_specs(model: BenchModel, max_queued: int) -> list[bench_nodes.NodeSpec]:
    specs = bench_nodes.pd_specs(model.spec, SWEEP_ENGINE)
    specs[1].args += ["--max-inflight", "64", "--max-queued", str(max_queued)]
    return specs


def run(a: argparse.Namespace, model: BenchModel, slos: dict[str, float]) -> dict[str, Any]:
    rates = parse_rates(a.sweep)
    specs = pd_sweep_specs(model, a.max_queued)
    points = []
    with bench_nodes.running(specs, a.out / "logs" / "serve_sweep") as nodes:
        target = nodes.target("decode")

        async def go() -> None:
            for rate in rates:
                records, duration = await run_requests(target, workload(a, model, rate))
                m = metrics_of(records, duration, slos)
                refused = sum(1 for r in records if r.error and "RESOURCE_EXHAUSTED" in r.error)
                points.append({"rate": str(rate), "refused": refused, **m})
                good = m["goodput"]["request_goodput"]
                print(
                    f"rate {rate:>6}: {m['completed']:>4} ok, {m['failed']:>4} failed "
                    f"({refused} refused), {m['request_throughput']:.2f} req/s, goodput "
                    f"{good:.2f} req/s, TTFT p99 {m['ttft']['p99_ms']:.0f} ms"
                )

        asyncio.run(go())
    return {
        "benchmark": "serve_sweep",
        "environment": environment(),
        "load_average": load_average(),
        "model": {"name": model.name, "spec": model.spec},
        "engine": SWEEP_ENGINE,
        "decode": {"max_inflight": 64, "max_queued": a.max_queued},
        "workload": {
            "num_prompts": a.num_prompts,
            "input_len": a.input_len,
            "output_len": a.output_len,
            "burstiness": a.burstiness,
            "goodput_slos_ms": {k: v * 1e3 for k, v in slos.items()},
        },
        "points": points,
    }


def plot(result: dict[str, Any], out) -> None:
    if pyplot() is None:
        return
    points = result["points"]
    labels = [p["rate"] for p in points]
    xs = np.arange(len(points))
    with figure(out / "serve_sweep.png", ncols=2, width=5.5) as (_, axes):
        ax = axes[0]
        ax.plot(xs, [p["request_throughput"] for p in points], "o-", label="throughput")
        ax.plot(xs, [p["goodput"]["request_goodput"] for p in points], "s-", label="goodput")
        ax2 = ax.twinx()
        ax2.bar(xs, [p["refused"] for p in points], 0.3, color="#ee6677", alpha=0.5)
        ax2.set_ylabel("refused requests (RESOURCE_EXHAUSTED)")
        ax.set_xticks(xs, labels)
        ax.set_xlabel("offered rate, req/s")
        ax.set_ylabel("req/s")
        ax.set_title("throughput and goodput vs offered rate")
        ax.legend(fontsize=7, loc="upper left")
        ax = axes[1]
        ax.plot(xs, [p["ttft"]["p99_ms"] for p in points], "o-", label="p99")
        ax.plot(xs, [p["ttft"]["median_ms"] for p in points], "s-", label="median")
        ax.set_xticks(xs, labels)
        ax.set_yscale("log")
        ax.set_xlabel("offered rate, req/s")
        ax.set_ylabel("TTFT, ms")
        ax.set_title("TTFT vs offered rate (queueing past saturation)")
        ax.legend(fontsize=7)


def main(a: argparse.Namespace, model: BenchModel, slos: dict[str, float]) -> dict[str, Any]:
    result = run(a, model, slos)
    for p in result["points"]:
        if math.isinf(float(p["rate"])):
            p["rate"] = "inf"
    write_json(a.out / "serve_sweep.json", result)
    plot(result, a.out)
    return result
