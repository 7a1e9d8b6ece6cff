"""Serving benchmark, modelled on `vllm bench serve`: P/D (1 prefill + 1 decode node) against
one colocated node, each node pinned to its own core, the same client and workload.

1. Load: `--num-prompts` random prompts of `--input-len` tokens (optionally sharing a
   `--prefix-len` prefix), `--output-len` tokens each (EOS ignored), arriving as a gamma process
   (`--request-rate`, `--burstiness`; 1 = Poisson) with at most `--max-concurrency` in flight.
   Metrics: TTFT, TPOT, ITL, E2E (mean, median, p99), request and token throughput, goodput under
   `--goodput ttft:MS tpot:MS`.
2. Interference (DistServe's experiment, pdserve/bench/interference.py): decode ITL p99 alone and
   while long prompts arrive, over `--interference-rounds` alternating phase pairs.

Setups: `pd` (prefill on core 0, decode on core 1), `colocated` (core 0, one thread: the same
compute as one P/D role) and `colocated_2core` (both cores, two threads: the same hardware as
the whole P/D pair); the colocated node is `pdserve colocated` (the same front door).

    python -m pdserve.bench.serve [--quick] [--request-rate 4] [--input-len 512] ...
    pdserve bench serve ...   (--workload shared-prefix: prefill routing, serve_prefix.py)
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from pdserve.bench import interference, serve_prefix
from pdserve.bench.support import nodes as bench_nodes
from pdserve.bench.support.load import (
    RequestSpec,
    arrival_offsets,
    parse_goodput,
    random_prompts,
    run_requests,
    serving_metrics,
    warm_up,
)
from pdserve.bench.support.models import BenchModel, resolve
from pdserve.bench.support.util import (
    environment,
    exit_on_sigterm,
    figure,
    load_average,
    pyplot,
    write_json,
)

SETUPS = ["pd", "colocated", "colocated_2core"]
ENTRY = {"pd": "decode", "colocated": "colocated", "colocated_2core": "colocated"}
PD_TARGET = 1.3  # P/D decode ITL p99 under prefill interference <= 1.3x its quiet value
COLOCATED_EXPECTED = 2.0  # colocated: expected to degrade by more than this
LOAD_KEYS = [
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "input_len",
    "output_len",
    "prefix_len",
    "goodput",
    "seed",
    "api",
]


def setup_specs(setup: str, model: BenchModel) -> list[bench_nodes.NodeSpec]:
    if setup == "pd":
        return bench_nodes.pd_specs(model.spec)
    if setup == "colocated":
        return [bench_nodes.colocated_spec(model.spec)]
    cpus = ",".join(str(c) for c in bench_nodes.cpu_ids()[:2])
    return [bench_nodes.colocated_spec(model.spec, cpus=cpus, threads=2)]


# ---- workloads ----------------------------------------------------------------------------------
def load_workload(a: argparse.Namespace, model: BenchModel, variant: int = 0) -> list[RequestSpec]:
    """`variant` > 0: other prompt tokens, the same lengths and arrivals (a second API's run on
    the same cluster must not find the first run's prompts in the prefix caches)."""
    rng = np.random.default_rng(a.seed)
    n, vocab = a.num_prompts, model.prompt_vocab
    prompts = random_prompts(n, a.input_len, vocab, rng, a.prefix_len)
    offsets = arrival_offsets(n, a.request_rate, a.burstiness, rng)
    if variant:
        other = np.random.default_rng([a.seed, variant])
        prompts = random_prompts(n, a.input_len, vocab, other, a.prefix_len)
    return [RequestSpec(p, a.output_len, t) for p, t in zip(prompts, offsets, strict=True)]


def run_setup(
    setup: str, a: argparse.Namespace, model: BenchModel, slos: dict[str, float], bar: tqdm
) -> dict[str, Any]:
    specs = setup_specs(setup, model)
    with bench_nodes.running(specs, a.out / "logs" / f"serve_{setup}") as nodes:
        idle = nodes.idle_cpu(1.0 if a.quick else 3.0)
        target = nodes.target(ENTRY[setup])

        async def go() -> dict[str, Any]:
            out: dict[str, Any] = {}
            for i, api in enumerate(a.api if setup == "pd" else ["grpc"]):  # HTTP: decode only
                api_target = target if api == "grpc" else nodes.http_url(ENTRY[setup])
                await warm_up(api_target, model.prompt_vocab)
                bar.set_postfix_str(f"{setup}: load ({api})")
                records, duration = await run_requests(
                    api_target, load_workload(a, model, i), a.max_concurrency
                )
                out.setdefault("load_by_api", {})[api] = serving_metrics(records, duration, slos)
            out["load"] = next(iter(out["load_by_api"].values()))
            if len(out["load_by_api"]) == 2:
                out["http_overhead_ms"] = http_overhead(out["load_by_api"])
            if not a.no_interference and setup in ("pd", "colocated"):
                out["interference"] = await interference.interference(target, a, model, bar)
            return out

        result = asyncio.run(go())
    result["idle_cpu_percent"] = idle
    result["nodes"] = [f"{s.name}: cpus {s.cpus}, {s.threads} thread(s)" for s in specs]
    return result


def http_overhead(by_api: dict[str, Any]) -> dict[str, float]:
    """What the HTTP layer adds over gRPC at the same load: p50 TTFT and per-token (ITL, TPOT)."""
    o, g = by_api["openai"], by_api["grpc"]
    return {
        "ttft_p50": o["ttft"]["median_ms"] - g["ttft"]["median_ms"],
        "itl_p50": o["itl"]["median_ms"] - g["itl"]["median_ms"],
        "tpot_p50": o["tpot"]["median_ms"] - g["tpot"]["median_ms"],
    }


# ---- output -------------------------------------------------------------------------------------
def targets(results: dict[str, Any]) -> dict[str, Any]:
    def ratio_of(setup: str) -> float | None:
        return results.get(setup, {}).get("interference", {}).get("p99_ratio")

    pd, colocated = ratio_of("pd"), ratio_of("colocated")
    idle = [v for r in results.values() for v in r["idle_cpu_percent"].values()]
    return {
        "pd_itl_p99_le_1_3x": {
            "ratio": pd,
            "target": PD_TARGET,
            "met": None if pd is None else pd <= PD_TARGET,
        },
        "colocated_itl_p99_gt_2x": {
            "ratio": colocated,
            "expected": COLOCATED_EXPECTED,
            "observed": None if colocated is None else colocated > COLOCATED_EXPECTED,
        },
        "idle_node_lt_5pct_core": {
            "worst_percent": max(idle) if idle else None,
            "met": bool(idle) and max(idle) < 5.0,
        },
    }


def plot(result: dict[str, Any], out: Path) -> None:
    if pyplot() is None:
        return
    setups = list(result["setups"])
    with figure(out / "serve.png", ncols=3, width=5.5) as (_, axes):
        ax = axes[0]
        metrics = ["ttft", "tpot", "itl"]
        width = 0.8 / max(1, len(setups))
        for i, setup in enumerate(setups):
            load = result["setups"][setup]["load"]
            xs = np.arange(len(metrics)) + i * width
            ax.bar(xs, [load[m]["median_ms"] for m in metrics], width, label=f"{setup} median")
            ax.plot(xs, [load[m]["p99_ms"] for m in metrics], "k_", ms=12)
        ax.set_xticks(np.arange(len(metrics)) + width * (len(setups) - 1) / 2, metrics)
        ax.set_yscale("log")
        ax.set_ylabel("ms (bars: median, ticks: p99)")
        ax.set_title("load run")
        ax.legend(fontsize=7)
        runs = [s for s in setups if "interference" in result["setups"][s]]
        ax = axes[1]
        for i, setup in enumerate(runs):
            r = result["setups"][setup]["interference"]
            values = [
                r["decode_itl_alone_s"]["p99"] * 1e3,
                r["decode_itl_with_long_prompts_s"]["p99"] * 1e3,
            ]
            ax.bar([i - 0.2, i + 0.2], values, 0.4, color=["#4477aa", "#ee6677"])
            ax.text(i, max(values), f"{r['p99_ratio'] or 0:.2f}x", ha="center", va="bottom")
        ax.set_xticks(range(len(runs)), runs)
        ax.set_ylabel("decode ITL p99, ms (blue: alone, red: with long prompts)")
        ax.set_title("prefill interference (DistServe)")
        ax = axes[2]
        for setup in runs:
            tl = result["setups"][setup]["interference"]["timeline"]
            ax.plot(tl["t_s"], np.array(tl["itl_s"]) * 1e3, ".", ms=2, label=setup)
            for t in tl["long_at_s"]:
                ax.axvline(t, color="grey", lw=0.5, alpha=0.5)
        ax.set_xlabel("s (grey: a long prompt arrives)")
        ax.set_ylabel("decode ITL, ms")
        ax.set_yscale("log")
        ax.set_title("decode token gaps over time")
        ax.legend(fontsize=7)


def print_summary(result: dict[str, Any]) -> None:
    print(
        f"{'setup':>16} {'req/s':>6} {'out tok/s':>9} {'TTFT p50/p99 ms':>16} "
        f"{'TPOT p50':>8} {'ITL p99':>8} {'goodput':>7}"
    )
    for setup, r in result["setups"].items():
        m = r["load"]
        good = m.get("goodput", {}).get("request_goodput", 0.0)
        print(
            f"{setup:>16} {m['request_throughput']:>6.2f} {m['output_throughput']:>9.1f} "
            f"{m['ttft']['median_ms']:>7.1f}/{m['ttft']['p99_ms']:<8.1f} "
            f"{m['tpot']['median_ms']:>8.2f} {m['itl']['p99_ms']:>8.2f} {good:>7.2f}"
        )
        if "interference" in r:
            i = r["interference"]
            print(
                f"{'':>16} decode ITL p99 {i['decode_itl_alone_s']['p99'] * 1e3:.2f} ms alone, "
                f"{i['decode_itl_with_long_prompts_s']['p99'] * 1e3:.2f} ms with long prompts: "
                f"{i['p99_ratio'] or 0:.2f}x (rounds pooled; each: "
                + " ".join(f"{r['p99_ratio'] or 0:.2f}" for r in i["rounds"])
                + ")"
            )
        if "http_overhead_ms" in r:
            h = r["http_overhead_ms"]
            print(
                f"{'':>16} HTTP over gRPC: TTFT p50 {h['ttft_p50']:+.2f} ms, ITL p50 "
                f"{h['itl_p50']:+.3f} ms, TPOT p50 {h['tpot_p50']:+.3f} ms"
            )
    for name, check in result["targets"].items():
        print(f"  {name}: {check}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few small requests (CI smoke test)")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--model", default="tiny", help="tiny or medium (pdserve.bench.support.models)")
    p.add_argument("--setups", default=None, help=f"comma list of {SETUPS}")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=None, help="req/s; inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1: Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--prefix-len", type=int, default=0, help="tokens shared by every prompt")
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs, e.g. ttft:500 tpot:50")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--api",
        default="grpc",
        help="grpc, openai, or both (e.g. grpc,openai): P/D's load through each, same workload",
    )
    p.add_argument(
        "--sweep", default="", metavar="RATES", help="request-rate sweep, e.g. 4,8,16,inf"
    )
    p.add_argument("--max-queued", type=int, default=100, help="decode node queue (--sweep)")
    serve_prefix.add_arguments(p)  # --workload shared-prefix and its flags
    interference.add_arguments(p)
    a = p.parse_args(argv)
    quick = a.quick
    defaults = {
        "setups": "pd,colocated" if quick else ",".join(SETUPS),
        "num_prompts": 6 if quick else 64,
        "request_rate": float("inf") if quick else 4.0,
        "max_concurrency": 4 if quick else 16,
        "input_len": 64 if quick else 512,
        "output_len": 8 if quick else 64,
        "goodput": ["ttft:1000", "tpot:50"],
        "decode_streams": 2 if quick else 8,
        "decode_output_len": 24 if quick else 512,
        "long_prompts": 2 if quick else 8,
        "long_input_len": 256 if quick else 2048,
        "interference_rounds": 1 if quick else 5,
    }
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.setups = a.setups.split(",")
    a.api = a.api.split(",")
    if not a.api or set(a.api) - {"grpc", "openai"}:
        p.error(f"--api takes grpc, openai or both, got {a.api}")
    unknown = set(a.setups) - set(SETUPS)
    if unknown:
        p.error(f"unknown setups {sorted(unknown)}; choose from {SETUPS}")
    if a.interference_rounds < 1:
        p.error(f"--interference-rounds must be >= 1, got {a.interference_rounds}")
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    exit_on_sigterm()
    slos = parse_goodput(a.goodput)
    model = resolve(a.model, a.out / "models")
    if a.sweep:  # past saturation: pdserve/bench/serve_sweep.py
        from pdserve.bench import serve_sweep

        return serve_sweep.main(a, model, slos)
    if a.workload == "shared-prefix":  # the prefill-routing comparison: pdserve/bench/serve_prefix
        return serve_prefix.main(a, model, slos)
    load_at_start = load_average()
    results: dict[str, Any] = {}
    bar = tqdm(a.setups, desc="serve", unit="setup")
    for setup in bar:
        results[setup] = run_setup(setup, a, model, slos, bar)
    bar.close()
    result = {
        "benchmark": "serve",
        "environment": environment(),
        "load_average": {"start": load_at_start, "end": load_average()},
        "model": {"name": model.name, "spec": model.spec},
        "workload": {k: getattr(a, k) for k in LOAD_KEYS},
        "interference_workload": {k: getattr(a, k) for k in interference.KEYS},
        "setups": results,
    }
    result["targets"] = targets(results)
    result["workload"]["request_rate"] = str(a.request_rate)  # JSON has no inf
    write_json(a.out / "serve.json", result)
    plot(result, a.out)
    print_summary(result)
    return result


if __name__ == "__main__":
    main()
