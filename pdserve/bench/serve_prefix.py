"""`pdserve bench serve --workload shared-prefix`: the decode node's prefill routing compared.

Two prefill nodes (core 0 and core 1) and one decode node (both cores, one thread) that sends
every prompt to a prefill node (`--local-prefill-tokens 0`: the decode node's own prefix cache
would otherwise keep the short uncached tails local, and this run compares where prefills go).
One fresh cluster per `--routing` mode (`kv`, `least-loaded`, `round-robin`: the decode node's
`--prefill-routing`), the same shared-prefix workload (pdserve/bench/support/workloads.py) through
the same arrival model each time. Per mode: TTFT, throughput, and the prefill prefix-hit rate:
cached / (cached + computed) prompt tokens summed over both prefill nodes, from each node's
`pdserve_prompt_tokens_total{source}` scraped before and after the run. Beside them, the hit
rate one shared cache of both nodes' blocks would reach on the same requests in the same order
(pdserve/bench/support/prefix_cache_sim.py), and the benchmark's ratios: kv hit / shared-cache hit
(target >= 0.9) and least-loaded TTFT p50 / kv TTFT p50 (target >= 2).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from pdserve.bench.support import nodes as bench_nodes
from pdserve.bench.support.load import (
    RequestSpec,
    arrival_offsets,
    run_requests,
    serving_metrics,
    warm_up,
)
from pdserve.bench.support.models import BenchModel
from pdserve.bench.support.prefix_cache_sim import replay_shared_cache
from pdserve.bench.support.prefix_report import plot, print_summary, targets
from pdserve.bench.support.util import environment, load_average, write_json
from pdserve.bench.support.workloads import (
    SharedPrefixConfig,
    WorkloadRequest,
    shared_prefix_requests,
)
from shared.serving.metrics import parse_prometheus_text

ROUTINGS = ["kv", "least-loaded", "round-robin"]
PREFILLS = ["prefill-a", "prefill-b"]
BLOCK_SIZE = 16  # every node's --block-size: the KV layout the shared-cache replay uses
SOURCES = ("computed", "cached")
PROMPT_TOKENS = 'pdserve_prompt_tokens_total{{source="{}"}}'
LOCAL_PREFILL = "off (--local-prefill-tokens 0): every prompt is prefilled on a prefill node"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        choices=["random", "shared-prefix"],
        default="random",
        help="random: P/D vs colocated (the setups); shared-prefix: 2 prefill nodes, the "
        "decode node's --prefill-routing compared (--routing)",
    )
    g = p.add_argument_group("shared-prefix workload (--workload shared-prefix)")
    g.add_argument("--routing", default=",".join(ROUTINGS), help=f"comma list of {ROUTINGS}")
    g.add_argument("--num-system-prompts", type=int, default=4)
    g.add_argument("--system-prompt-len", type=int, default=None, help="tokens (default 1024)")
    g.add_argument("--user-len", type=int, default=None, help="user message tokens (default 64)")
    g.add_argument("--num-conversations", type=int, default=None, help="multi-turn (default 8)")
    g.add_argument("--turns", type=int, default=None, help="per conversation (default 4)")
    g.add_argument(
        "--prefill-kv-blocks",
        type=int,
        default=0,
        help="each prefill node's KV pool in blocks of 16 tokens (0: the node's default, "
        "sized from the memory free: --kv-cache-memory-fraction); the prefix-cache capacity "
        "routing has to share",
    )


def _given(value: int | None, quick: int, full: int, is_quick: bool) -> int:
    return value if value is not None else quick if is_quick else full


def workload_config(a: argparse.Namespace) -> SharedPrefixConfig:
    q = a.quick
    return SharedPrefixConfig(
        num_requests=a.num_prompts,
        num_system_prompts=a.num_system_prompts,
        system_prompt_len=_given(a.system_prompt_len, 64, 1024, q),
        user_len=_given(a.user_len, 16, 64, q),
        num_conversations=_given(a.num_conversations, 2, 8, q),
        turns=_given(a.turns, 2, 4, q),
        answer_len=a.output_len,  # what the model answered: as long as the requests ask for
    )


def load_workload(
    a: argparse.Namespace, model: BenchModel
) -> tuple[list[WorkloadRequest], list[RequestSpec]]:
    requests = shared_prefix_requests(workload_config(a), model.prompt_vocab, a.seed)
    rng = np.random.default_rng(a.seed + 1)
    offsets = arrival_offsets(len(requests), a.request_rate, a.burstiness, rng)
    specs = [
        RequestSpec(r.prompt, a.output_len, t, r.kind)
        for r, t in zip(requests, offsets, strict=True)
    ]
    return requests, specs


def cluster_specs(model: BenchModel, routing: str, kv_blocks: int) -> list[bench_nodes.NodeSpec]:
    both = ",".join(str(c) for c in bench_nodes.cpu_ids()[:2])
    base = bench_nodes.engine_args(model.spec, {"block_size": BLOCK_SIZE})
    pool = ["--num-kv-blocks", str(kv_blocks)] if kv_blocks else []
    specs = [
        bench_nodes.NodeSpec(name, "pdserve.cli", ["prefill", *base, *pool, "--port", "0"], cpus)
        for name, cpus in zip(PREFILLS, [bench_nodes.core(0), bench_nodes.core(1)], strict=True)
    ]
    decode = ["decode", *base, "--port", "0", "--http-port", "-1"]
    decode += ["--prefill", ",".join(f"{{port:{n}}}" for n in PREFILLS)]
    decode += ["--prefill-routing", routing, "--local-prefill-tokens", "0"]
    return [*specs, bench_nodes.NodeSpec("decode", "pdserve.cli", decode, both)]


async def scrape(url: str) -> dict[str, float]:
    import httpx

    async with httpx.AsyncClient(timeout=30.0) as client:
        resp = await client.get(url)
        resp.raise_for_status()
        return parse_prometheus_text(resp.text)


def prefill_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """One prefill node's prompt tokens over the run, and its KV pool size."""
    out = {s: after[PROMPT_TOKENS.format(s)] - before[PROMPT_TOKENS.format(s)] for s in SOURCES}
    out["kv_blocks_total"] = after["pdserve_kv_blocks_total"]
    return out


def hit_rate(cached: float, computed: float) -> float:
    return cached / (cached + computed) if cached + computed else 0.0


def run_mode(
    routing: str,
    a: argparse.Namespace,
    model: BenchModel,
    specs: list[RequestSpec],
    slos: dict[str, float],
) -> dict[str, Any]:
    nodes_spec = cluster_specs(model, routing, a.prefill_kv_blocks)
    with bench_nodes.running(nodes_spec, a.out / "logs" / f"serve_prefix_{routing}") as nodes:
        urls = {name: nodes.metrics_url(name) for name in PREFILLS}
        target = nodes.target("decode")

        async def go() -> tuple[Any, float, dict[str, Any], dict[str, Any]]:
            await warm_up(target, model.prompt_vocab)
            before = {name: await scrape(url) for name, url in urls.items()}
            records, duration = await run_requests(target, specs, a.max_concurrency)
            after = {name: await scrape(url) for name, url in urls.items()}
            return records, duration, before, after

        records, duration, before, after = asyncio.run(go())
    # every node checks at shutdown that all seats and blocks are back (else exit code 3)
    exit_codes = {name: node.proc.returncode for name, node in nodes.nodes.items()}
    per_node = {name: prefill_delta(before[name], after[name]) for name in PREFILLS}
    cached = sum(n["cached"] for n in per_node.values())
    computed = sum(n["computed"] for n in per_node.values())
    return {
        "load": serving_metrics(records, duration, slos),
        "ttft_by_kind": {  # single-turn users on a system prompt / conversation turns
            kind: serving_metrics([r for r in records if r.spec.group == kind], duration)["ttft"]
            for kind in ("user", "conversation")
        },
        "node_timing_p50_ms": node_timing(records),
        "prefill_nodes": per_node,
        "prefill_prompt_tokens": {"cached": cached, "computed": computed},
        "hit_rate": hit_rate(cached, computed),
        "exit_codes": exit_codes,
        "nodes": [f"{s.name}: cpus {s.cpus}, {s.threads} thread(s)" for s in nodes_spec],
    }


def node_timing(records: list[Any]) -> dict[str, float]:
    """Median of the decode node's own TTFT breakdown (queue on the prefill node, prefill
    compute, KV transfer, node TTFT), ms: where a routing mode's TTFT goes."""
    keys = ("queue", "prefill", "kv_transfer", "ttft")
    done = [r.timing for r in records if r.ok and r.timing]
    return {k: statistics.median(t.get(k, 0.0) for t in done) * 1e3 for k in keys if done}


def shared_cache(requests: list[WorkloadRequest], capacity_blocks: int) -> dict[str, Any]:
    replay = replay_shared_cache((r.prompt for r in requests), BLOCK_SIZE, capacity_blocks)
    return {
        "capacity_blocks": capacity_blocks,
        "block_size": BLOCK_SIZE,
        "cached": replay.cached_tokens,
        "computed": replay.computed_tokens,
        "hit_rate": replay.hit_rate,
    }


def parse_routings(text: str) -> list[str]:
    routings = [r for r in text.split(",") if r]
    unknown = set(routings) - set(ROUTINGS)
    if not routings or unknown:
        raise SystemExit(f"--routing: unknown {sorted(unknown)}; choose from {ROUTINGS}")
    return routings


def main(a: argparse.Namespace, model: BenchModel, slos: dict[str, float]) -> dict[str, Any]:
    routings = parse_routings(a.routing)
    config = workload_config(a)
    if config.max_prompt_len() + a.output_len > model.max_context:
        raise SystemExit(f"prompts up to {config.max_prompt_len()} tokens exceed the model")
    requests, specs = load_workload(a, model)
    load_at_start = load_average()
    modes: dict[str, Any] = {}
    bar = tqdm(routings, desc="serve shared-prefix", unit="routing")
    for routing in bar:
        bar.set_postfix_str(routing)
        modes[routing] = run_mode(routing, a, model, specs, slos)
    bar.close()
    capacity = int(sum(n["kv_blocks_total"] for n in modes[routings[0]]["prefill_nodes"].values()))
    result = workload_result(a, model, config, requests)
    result.update(
        load_average={"start": load_at_start, "end": load_average()},
        shared_cache=shared_cache(requests, capacity),
        modes=modes,
    )
    result["targets"] = targets(result)
    write_json(a.out / "serve_prefix.json", result)
    plot(result, Path(a.out) / "serve_prefix.png")
    print_summary(result)
    return result


def workload_result(
    a: argparse.Namespace,
    model: BenchModel,
    config: SharedPrefixConfig,
    requests: list[WorkloadRequest],
) -> dict[str, Any]:
    lens = [len(r.prompt) for r in requests]
    return {
        "benchmark": "serve_prefix",
        "environment": environment(),
        "model": {"name": model.name, "spec": model.spec},
        "workload": {
            "kind": "shared-prefix",
            **{k: getattr(config, k) for k in config.__dataclass_fields__},
            "num_users": config.num_users,
            "prompt_tokens": {"min": min(lens), "max": max(lens), "mean": float(np.mean(lens))},
            "output_len": a.output_len,
            "request_rate": str(a.request_rate),  # JSON has no inf
            "burstiness": a.burstiness,
            "max_concurrency": a.max_concurrency,
            "seed": a.seed,
        },
        "local_prefill": LOCAL_PREFILL,
        "prefill_kv_blocks": a.prefill_kv_blocks or "node default (--kv-cache-memory-fraction)",
    }
