"""Check one `pdserve plan` recommendation against measured runs on this machine.

Plans the workload from `--profile` (with --quick and no profile: one measured first by
`bench profile --quick`), then runs, under the same Poisson load (`--num-prompts` requests at
`--rate`, EOS ignored), the recommended configuration and the one with one node fewer of the
recommended kind (one prefill node fewer of 1P+1D: a decode node that prefills every prompt
itself, i.e. one colocated node). Nodes are real processes, each pinned to its own core with one
torch thread, decode nodes with local prefill off (every prompt goes to the prefill nodes, as the
plan assumes). For each run: TTFT at the plan's quantile, mean ITL, and whether both targets are
met; beside them, what the model predicts for that run's own arrivals (a run of a few hundred
requests has a quantile of its own: this tells the model's error from the sample's). The check
holds when the recommendation meets both targets and the smaller configuration misses.

    pdserve bench plan-check --profile DIR/profile.json --rate 4 --prompt-len 512 \\
        --output-len 32 --ttft-slo-ms 300 --itl-slo-ms 15 [--num-prompts 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pdserve import planner_sim
from pdserve.bench import profile as bench_profile
from pdserve.bench.support import nodes as bench_nodes
from pdserve.bench.support.load import (
    RequestRecord,
    RequestSpec,
    arrival_offsets,
    random_prompts,
    run_requests,
    warm_up,
)
from pdserve.bench.support.models import BenchModel, resolve
from pdserve.bench.support.util import environment, exit_on_sigterm, load_average, write_json
from pdserve.plan import Plan, make_plan, to_json
from pdserve.planner_model import Targets, Workload, decode_tier
from pdserve.planner_profile import Profile


def configurations(plan: Plan) -> dict[str, tuple[int, int]]:
    """(prefill nodes, decode nodes) of the recommendation and of one node fewer of its kind;
    0 prefill nodes: colocated nodes."""
    best = plan.recommended
    if best is None:
        return {}
    p, d = best.prefill_nodes, best.decode_nodes
    fewer = (p - 1, d) if p > 0 else (0, d - 1)
    out = {"recommended": (p, d)}
    if fewer[1] > 0:
        out["one_node_fewer"] = fewer
    return out


def node_specs(model: BenchModel, prefill: int, decode: int) -> list[bench_nodes.NodeSpec]:
    """`prefill` prefill nodes on cores 0.., one decode node on the next; without prefill nodes,
    one colocated node on core 0."""
    engine = bench_nodes.engine_args(model.spec, bench_profile.ENGINE)
    if prefill == 0:
        return [bench_nodes.colocated_spec(model.spec, bench_profile.ENGINE)]
    specs = [
        bench_nodes.NodeSpec(f"p{i}", "pdserve.cli", ["prefill", *engine, "--port", "0"], cpus)
        for i, cpus in enumerate(bench_nodes.core(i) for i in range(prefill))
    ]
    targets = ",".join(f"{{port:p{i}}}" for i in range(prefill))
    args = ["decode", *engine, "--port", "0", "--http-port", "0", "--prefill", targets]
    args += bench_profile.LOCAL_PREFILL_OFF
    return [*specs, bench_nodes.NodeSpec("decode", "pdserve.cli", args, bench_nodes.core(prefill))]


def measured(records: list[RequestRecord], targets: Targets) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok]
    gaps = [g for r in ok for g in r.itls]
    ttft_q = float(np.quantile(ttfts, targets.quantile)) if ttfts else float("inf")
    itl_mean = float(np.mean(gaps)) if gaps else float("inf")
    failed = len(records) - len(ok)
    return {
        "completed": len(ok),
        "failed": failed,
        "errors": sorted({r.error for r in records if r.error})[:3],
        f"ttft_p{targets.quantile * 100:g}_ms": ttft_q * 1e3,
        "ttft_median_ms": float(np.median(ttfts)) * 1e3 if ttfts else None,
        "itl_mean_ms": itl_mean * 1e3,
        "itl_p90_ms": float(np.quantile(gaps, 0.9)) * 1e3 if gaps else None,
        # the node's own account (prefill: its compute; queue: before it): against the profile
        "node_prefill_median_ms": _median_ms([r.timing.get("prefill", 0.0) for r in ok]),
        "node_queue_median_ms": _median_ms([r.timing.get("queue", 0.0) for r in ok]),
        "meets_ttft": ttft_q <= targets.ttft_s and failed == 0,
        "meets_itl": itl_mean <= targets.itl_s,
        "meets": ttft_q <= targets.ttft_s and itl_mean <= targets.itl_s and failed == 0,
        "slowest_first_tokens": [_account(r) for r in sorted(ok, key=lambda r: -r.ttft)[:5]],
    }


def _account(r: RequestRecord) -> dict[str, float]:
    """Where a slow first token's time went: its arrival, the client's TTFT, the nodes' parts."""
    parts = {f"{k}_ms": v * 1e3 for k, v in r.timing.items() if k != "e2e"}
    return {"arrival_s": r.spec.arrival, "client_ttft_ms": r.ttft * 1e3, **parts}


def _median_ms(xs: list[float]) -> float | None:
    return float(np.median(xs)) * 1e3 if xs else None


def replayed(
    profile: Profile, a: argparse.Namespace, counts: tuple[int, int], arrivals: np.ndarray
) -> dict[str, float]:
    """The model's prediction for this run's own arrivals (TTFT at the quantile, mean ITL): a
    run of a few hundred requests has a p90 of its own, which the plan's long-run one is not.
    Set against the measured one, it tells the model's error from the sample's."""
    prefill, decode = counts
    q = a.quantile
    if prefill == 0:
        run = planner_sim.colocated_node(profile, a.prompt_len, a.output_len, arrivals)
        return {
            f"ttft_p{q * 100:g}_ms": float(np.quantile(run.ttfts, q)) * 1e3,
            "itl_mean_ms": float(np.mean(run.itls)) * 1e3,
        }
    ttfts = planner_sim.prefill_tier_ttfts(profile, a.prompt_len, prefill, arrivals)
    work = Workload(a.rate, a.prompt_len, a.output_len)
    return {
        f"ttft_p{q * 100:g}_ms": float(np.quantile(ttfts, q)) * 1e3,
        "itl_mean_ms": decode_tier(profile, work, decode)[0] * 1e3,
    }


def run_config(
    a: argparse.Namespace,
    model: BenchModel,
    label: str,
    counts: tuple[int, int],
    targets: Targets,
    profile: Profile,
) -> dict[str, Any]:
    rng = np.random.default_rng(a.seed)
    prompts = random_prompts(a.num_prompts, a.prompt_len, model.prompt_vocab, rng)
    offsets = arrival_offsets(a.num_prompts, a.rate, 1.0, rng)
    work = [RequestSpec(p, a.output_len, t) for p, t in zip(prompts, offsets, strict=True)]
    specs = node_specs(model, *counts)
    load_at_start = load_average()
    with bench_nodes.running(specs, a.out / "logs" / label) as nodes:
        front = nodes.target(specs[-1].name)

        async def go() -> list[RequestRecord]:
            await warm_up(front, model.prompt_vocab)
            records, _ = await run_requests(front, work)
            return records

        records = asyncio.run(go())
    result = {"prefill_nodes": counts[0], "decode_nodes": counts[1], **measured(records, targets)}
    result["predicted_for_these_arrivals"] = replayed(profile, a, counts, np.asarray(offsets))
    result["nodes"] = [f"{s.name}: cpus {s.cpus}" for s in specs]
    result["load_average"] = {"start": load_at_start, "end": load_average()}
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few small requests (CI smoke test)")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--profile", type=Path, default=None, help="profile.json (bench profile)")
    p.add_argument("--model", default=None, help="default: the profile's")
    p.add_argument("--rate", type=float, default=None, help="requests/s, Poisson")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--ttft-slo-ms", type=float, default=None)
    p.add_argument("--itl-slo-ms", type=float, default=None)
    p.add_argument("--quantile", type=float, default=0.9)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    quick = {
        "rate": 2.0,
        "prompt_len": 128,
        "output_len": 8,
        "ttft_slo_ms": 2000.0,
        "itl_slo_ms": 200.0,
        "num_prompts": 8,
    }
    for key, value in quick.items():
        if getattr(a, key) is None:
            if not a.quick and key != "num_prompts":
                p.error(f"--{key.replace('_', '-')} is required (or --quick)")
            setattr(a, key, value if a.quick else 200)
    if a.profile is None and not a.quick:
        p.error("--profile is required (or --quick, which measures one)")
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    exit_on_sigterm()
    if a.profile is None:
        bench_profile.main(["--quick", "--out", str(a.out / "profile")])
        a.profile = a.out / "profile" / "profile.json"
    data = json.loads(a.profile.read_text())
    model = resolve(a.model or data["model"]["name"], a.out / "models")
    if not model.max_context:  # not built in: as the profile's nodes described it
        model = replace(
            model,
            max_context=data["model"]["max_context"],
            prompt_vocab=data["model"]["vocab_size"],
        )
    work = Workload(a.rate, a.prompt_len, a.output_len)
    targets = Targets(a.ttft_slo_ms / 1e3, a.itl_slo_ms / 1e3, a.quantile)
    profile = Profile.from_dict(data)
    plan = make_plan(profile, work, targets, len(bench_nodes.cpu_ids()))
    runs: dict[str, Any] = {}
    for label, (prefill, decode) in configurations(plan).items():
        if decode != 1:  # the load goes to one front door: more decode nodes need a router
            runs[label] = {"skipped": f"{prefill}P+{decode}D: the check runs one decode node"}
            continue
        runs[label] = run_config(a, model, label, (prefill, decode), targets, profile)
    check = {
        "recommended_meets": runs.get("recommended", {}).get("meets"),
        "one_node_fewer_misses": _negate(runs.get("one_node_fewer", {}).get("meets")),
    }
    result = {
        "benchmark": "plan_check",
        "environment": environment(),
        "profile": str(a.profile),
        "model": model.name,
        "num_prompts": a.num_prompts,
        "plan": to_json(plan),
        "runs": runs,
        "check": check,
    }
    write_json(a.out / "plan_check.json", result)
    print_summary(result, targets)
    return result


def _negate(meets: bool | None) -> bool | None:
    return None if meets is None else not meets


def print_summary(result: dict[str, Any], targets: Targets) -> None:
    q = f"p{targets.quantile * 100:g}"
    print(f"recommendation: {result['plan']['recommendation']}; check: {result['check']}")
    for label, r in result["runs"].items():
        if "skipped" in r:
            print(f"{label:>15}: skipped: {r['skipped']}")
            continue
        print(
            f"{label:>15}: {r['prefill_nodes']}P+{r['decode_nodes']}D, {r['completed']} ok "
            f"{r['failed']} failed, TTFT {q} {r[f'ttft_{q}_ms']:.1f} ms, ITL mean "
            f"{r['itl_mean_ms']:.2f} ms: {'meets' if r['meets'] else 'misses'} "
            f"(load {r['load_average']['end']})"
        )
        p = r["predicted_for_these_arrivals"]
        print(
            f"{'':>15}  the model on these arrivals: TTFT {q} {p[f'ttft_{q}_ms']:.1f} ms, "
            f"ITL mean {p['itl_mean_ms']:.2f} ms"
        )


if __name__ == "__main__":
    main()
