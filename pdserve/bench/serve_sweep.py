"""Request-rate sweep past saturation (`pdserve bench serve --sweep 4,8,16,inf`).

One P/D pair (prefill on core 0, decode on core 1) with a deliberately small KV pool, the same
random workload at each rate: completed / refused requests, request throughput, goodput under
the SLOs and TTFT p99 against the offered rate. With the admission queue, past saturation the
extra requests wait (TTFT grows with the queue) instead of failing, goodput stays flat, and
only what overflows `--max-queued` is refused (RESOURCE_EXHAUSTED).

Then SLO-aware admission off vs on (shared/engine/scheduling/slo.py), in the same run: at half
capacity,
at capacity (the sweep's finite rate with the highest goodput) and at twice it, the same workload
against the sweep's decode node (off) and against a fresh pair whose decode node runs
`--ttft-slo-ms` at the goodput TTFT target (on): a request predicted to miss it is refused at
once instead of being admitted to miss it and make those behind it miss too.
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


def pd_sweep_specs(
    model: BenchModel, max_queued: int, ttft_slo_ms: float | None = None
) -> list[bench_nodes.NodeSpec]:
    specs = bench_nodes.pd_specs(model.spec, SWEEP_ENGINE)
    specs[1].args += ["--max-inflight", "64", "--max-queued", str(max_queued)]
    if ttft_slo_ms is not None:
        specs[1].args += ["--ttft-slo-ms", str(ttft_slo_ms)]
    return specs


async def measure(
    a: argparse.Namespace, model: BenchModel, target: str, rate: float, slos: dict[str, float]
) -> dict[str, Any]:
    records, duration = await run_requests(target, workload(a, model, rate))
    m = metrics_of(records, duration, slos)
    refused = sum(1 for r in records if r.error and "RESOURCE_EXHAUSTED" in r.error)
    admitted = [r.ttft for r in records if r.ok]  # the acceptance reads p90 of these
    p90 = float(np.percentile(admitted, 90)) * 1e3 if admitted else None
    return {"rate": str(rate), "refused": refused, "ttft_p90_ms": p90, **m}


def capacity(points: list[dict[str, Any]]) -> float | None:
    """The finite swept rate with the highest goodput."""
    finite = [p for p in points if not math.isinf(float(p["rate"]))]
    best = max(finite, key=lambda p: p["goodput"]["request_goodput"], default=None)
    return None if best is None else float(best["rate"])


def slo_comparison(
    a: argparse.Namespace,
    model: BenchModel,
    off_target: str,
    points: list[dict[str, Any]],
    slos: dict[str, float],
) -> dict[str, Any] | None:
    """Goodput at half capacity (where nothing may be refused), at capacity and at 2x, SLO-aware
    admission off (the sweep's nodes) vs on."""
    cap = capacity(points)
    if cap is None or "ttft" not in slos:
        return None
    rates, ttft_ms = [cap / 2, cap, 2 * cap], slos["ttft"] * 1e3
    off = [asyncio.run(measure(a, model, off_target, r, slos)) for r in rates]
    specs = pd_sweep_specs(model, a.max_queued, ttft_slo_ms=ttft_ms)
    with bench_nodes.running(specs, a.out / "logs" / "serve_sweep_slo") as nodes:
        on = [asyncio.run(measure(a, model, nodes.target("decode"), r, slos)) for r in rates]
    labels = ("half capacity", "capacity", "2x capacity")
    for label, r_off, r_on in zip(labels, off, on, strict=True):
        print(
            f"SLO-aware admission at {label} ({r_off['rate']} req/s): goodput off "
            f"{r_off['goodput']['request_goodput']:.2f}, on "
            f"{r_on['goodput']['request_goodput']:.2f} req/s ({r_on['refused']} refused); "
            f"TTFT p90 of admitted off {r_off['ttft_p90_ms'] or 0:.0f}, "
            f"on {r_on['ttft_p90_ms'] or 0:.0f} ms"
        )
    return {"ttft_slo_ms": ttft_ms, "rates": rates, "off": off, "on": on}


def run(a: argparse.Namespace, model: BenchModel, slos: dict[str, float]) -> dict[str, Any]:
    rates = parse_rates(a.sweep)
    specs = pd_sweep_specs(model, a.max_queued)
    points = []
    with bench_nodes.running(specs, a.out / "logs" / "serve_sweep") as nodes:
        target = nodes.target("decode")
        for rate in rates:
            m = asyncio.run(measure(a, model, target, rate, slos))
            points.append(m)
            print(
                f"rate {rate:>6}: {m['completed']:>4} ok, {m['failed']:>4} failed "
                f"({m['refused']} refused), {m['request_throughput']:.2f} req/s, goodput "
                f"{m['goodput']['request_goodput']:.2f} req/s, TTFT p99 "
                f"{m['ttft']['p99_ms']:.0f} ms"
            )
        comparison = slo_comparison(a, model, target, points, slos)
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
        "slo_admission": comparison,
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
