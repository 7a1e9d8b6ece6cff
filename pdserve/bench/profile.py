"""What `pdserve plan` needs to know about this machine, measured on real nodes: profile.json.

Three nodes, one torch thread each: a prefill node (core 0), its decode node (core 1, every
prompt sent to the prefill node: local prefill off) and a colocated node (core 1; measured at
other times than the decode node). Phases, progress on stderr:

1. Prefill and transfer, one request at a time (an idle system), P/D and colocated alternating
   per prompt length: `prefill` is the prefill node's own compute (its Timing message);
   `transfer` is the P/D client TTFT minus that compute (what the P/D path adds to it: the RPC
   hop, the KV push, the first token's way back), with `bytes_per_token` from the KV layout and
   a fitted fixed cost and push throughput beside it; `colocated_ttft` is for reference.
2. Decode step by batch and context: B requests at once on the decode node; the step is the
   median gap between streamed tokens while all B are decoding.
3. Local prefill on a decode node: a colocated node decoding `--chunk-batch` requests gets a
   prompt of N tokens; `extra_s` is the longest token gap of the decodes while it was prefilled
   minus their median gap (what one prefill chunk adds to the step it rides on).

profile.json (`schema` "pdserve-profile", `version` 1; seconds throughout):
    chunk_tokens                      a colocated node's per-step token budget
    prefill_budget_tokens             a prefill node's (the prompts waiting share a step)
    prefill   {tokens[], seconds[]}   prefill node compute by prompt length
    transfer  {tokens[], seconds[], bytes_per_token, fixed_s, bytes_per_s}
    colocated_ttft {tokens[], seconds[]}  idle colocated TTFT (reference)
    decode    {contexts[], batches[], step_s[context][batch]}
    local_prefill {batch, tokens[], extra_s[]}
    model {name, spec, max_context, vocab_size}, environment, load_average {start, end},
    threads_per_node

    pdserve bench profile [--quick] [--model tiny|medium|smollm2|FILE.gguf|DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from pdserve.bench.support import nodes as bench_nodes
from pdserve.bench.support.load import RequestRecord, RequestSpec, random_prompts, run_requests
from pdserve.bench.support.models import BenchModel, described, resolve
from pdserve.bench.support.util import (
    environment,
    exit_on_sigterm,
    figure,
    load_average,
    pyplot,
    write_json,
)
from pdserve.planner_profile import PROFILE_SCHEMA, PROFILE_VERSION
from prefill_node.config import PREFILL_MAX_NUM_TOKENS
from shared.engine.config import EngineConfig

ENGINE = {"kv_cache_mb": 1024}  # room for the largest batch at the longest context
LOCAL_PREFILL_OFF = ["--local-prefill-tokens", "0", "--local-prefill-idle-tokens", "0"]
INJECT_GAP_S = 0.25  # between two prompts injected beside the decodes (phase 3)


def specs(model: BenchModel) -> list[bench_nodes.NodeSpec]:
    pd = bench_nodes.pd_specs(model.spec, ENGINE, decode_extra=LOCAL_PREFILL_OFF)
    return [*pd, bench_nodes.colocated_spec(model.spec, ENGINE, cpus=bench_nodes.core(1))]


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([1234, *key])


async def _one(target: str, prompt: list[int], max_tokens: int) -> RequestRecord:
    records, _ = await run_requests(target, [RequestSpec(prompt, max_tokens)])
    if not records[0].ok:
        raise RuntimeError(f"profile request to {target} failed: {records[0].error}")
    return records[0]


async def prefill_and_transfer(
    nodes: bench_nodes.RunningNodes, model: BenchModel, lengths: list[int], reps: int, bar: tqdm
) -> dict[str, Any]:
    pd, colocated = nodes.target("decode"), nodes.target("colocated")
    compute: dict[int, list[float]] = {n: [] for n in lengths}
    extra: dict[int, list[float]] = {n: [] for n in lengths}
    alone: dict[int, list[float]] = {n: [] for n in lengths}
    for rep in range(-1, reps):  # repeat -1: each length's first forwards, not counted
        for n in lengths:
            bar.set_postfix_str(f"prefill {n} tokens, repeat {rep + 1}")
            a, b = random_prompts(2, n, model.prompt_vocab, _rng(1, rep + 1, n))
            first = await _one(pd, a, 2)
            second = await _one(colocated, b, 2)
            if rep < 0:
                continue
            compute[n].append(first.timing["prefill"])
            extra[n].append(first.ttft - first.timing["prefill"])
            alone[n].append(second.ttft)
            bar.update()
    transfer = [max(0.0, statistics.median(extra[n])) for n in lengths]
    per_token, fixed = np.polyfit(lengths, transfer, 1) if len(lengths) > 1 else (0.0, 0.0)
    per_token = max(float(per_token), 1e-12)
    return {
        "prefill": {"tokens": lengths, "seconds": [statistics.median(compute[n]) for n in lengths]},
        "transfer": {
            "tokens": lengths,
            "seconds": transfer,
            "bytes_per_token": model.kv_bytes_per_token,
            "fixed_s": max(0.0, float(fixed)),
            "bytes_per_s": model.kv_bytes_per_token / per_token,
        },
        "colocated_ttft": {
            "tokens": lengths,
            "seconds": [statistics.median(alone[n]) for n in lengths],
        },
    }


def steady_gaps(records: list[RequestRecord]) -> list[float]:
    """Token gaps while every request was decoding (after the last first token, before the
    first request's last token); all gaps when that window holds none."""
    start = max(r.chunk_times[0] for r in records)
    end = min(r.chunk_times[-1] for r in records)
    inside = [g for r in records for g in _between(r, start, end)]
    return inside or [g for r in records for g in r.itls]


def _between(r: RequestRecord, start: float, end: float) -> list[float]:
    times = r.chunk_times
    return [b - a for a, b in pairwise(times) if a >= start and b <= end]


async def decode_steps(
    target: str, model: BenchModel, contexts: list[int], batches: list[int], tokens: int, bar: tqdm
) -> dict[str, Any]:
    rows = []
    for context in contexts:
        row = []
        for batch in batches:
            bar.set_postfix_str(f"decode batch {batch}, context {context}")
            prompts = random_prompts(batch, context, model.prompt_vocab, _rng(2, context, batch))
            records, _ = await run_requests(target, [RequestSpec(p, tokens) for p in prompts])
            failed = [r.error for r in records if not r.ok]
            if failed:
                raise RuntimeError(f"decode batch {batch} failed: {failed[0]}")
            row.append(statistics.median(steady_gaps(records)))
            bar.update()
        rows.append(row)
    return {"contexts": contexts, "batches": batches, "step_s": rows}


async def local_prefill(
    target: str, model: BenchModel, batch: int, sizes: list[int], reps: int, step_s: float
) -> dict[str, Any]:
    """`batch` long decodes on the colocated node and, every INJECT_GAP_S, one prompt of each
    size in turn (one output token): each prompt's cost to the decodes' step."""
    injected = [n for _ in range(reps) for n in sizes]
    duration = INJECT_GAP_S * (len(injected) + 2)
    room = model.max_context - 64
    decode_tokens = min(room, int(1.5 * duration / max(step_s, 1e-4)) + 32)
    rng = _rng(3, batch)
    work = [
        RequestSpec(p, decode_tokens) for p in random_prompts(batch, 64, model.prompt_vocab, rng)
    ]
    for i, n in enumerate(injected):
        prompt = random_prompts(1, n, model.prompt_vocab, rng)[0]
        work.append(RequestSpec(prompt, 1, arrival=INJECT_GAP_S * (i + 1), group=str(n)))
    records, _ = await run_requests(target, work)
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"local prefill phase failed: {failed[0]}")
    decodes = records[:batch]
    base = statistics.median(g for r in decodes for g in r.itls)
    extra: dict[int, list[float]] = {n: [] for n in sizes}
    for r in records[batch:]:
        start, end = r.start, r.chunk_times[0]
        overlapping = [
            b - a for d in decodes for a, b in pairwise(d.chunk_times) if b > start and a < end
        ]
        if overlapping:  # else the decodes had finished: no step carried it
            extra[int(r.spec.group)].append(max(0.0, max(overlapping) - base))
    measured = [n for n in sizes if extra[n]]
    return {
        "batch": batch,
        "base_step_s": base,
        "tokens": measured,
        "extra_s": [statistics.median(extra[n]) for n in measured],
    }


def plot(result: dict[str, Any], out: Path) -> None:
    if pyplot() is None:
        return
    with figure(out / "profile.png", ncols=3, width=5.0) as (_, axes):
        ax = axes[0]
        for key, label in (("prefill", "prefill node compute"), ("transfer", "P/D path added")):
            ax.plot(
                result[key]["tokens"], np.array(result[key]["seconds"]) * 1e3, "o-", label=label
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("ms")
        ax.set_title("prefill and transfer (idle)")
        ax.legend(fontsize=7)
        ax = axes[1]
        d = result["decode"]
        for context, row in zip(d["contexts"], d["step_s"], strict=True):
            ax.plot(d["batches"], np.array(row) * 1e3, "o-", label=f"context {context}")
        ax.set_xlabel("decode batch")
        ax.set_ylabel("step, ms")
        ax.set_title("decode step (token gap)")
        ax.legend(fontsize=7)
        ax = axes[2]
        lp = result["local_prefill"]
        ax.plot(lp["tokens"], np.array(lp["extra_s"]) * 1e3, "o-")
        ax.set_xlabel("prompt tokens prefilled beside the decodes")
        ax.set_ylabel("extra step time, ms")
        ax.set_title(f"local prefill on a decode node (batch {lp['batch']})")


def print_summary(result: dict[str, Any]) -> None:
    for key in ("prefill", "transfer", "colocated_ttft"):
        r = result[key]
        cells = " ".join(
            f"{n}:{s * 1e3:.1f}" for n, s in zip(r["tokens"], r["seconds"], strict=True)
        )
        print(f"{key:>15} ms by tokens  {cells}")
    t = result["transfer"]
    print(
        f"{'':>15} fit: {t['fixed_s'] * 1e3:.2f} ms + {t['bytes_per_token']} B/token at "
        f"{t['bytes_per_s'] / 1e9:.2f} GB/s"
    )
    d = result["decode"]
    for context, row in zip(d["contexts"], d["step_s"], strict=True):
        cells = " ".join(f"{b}:{s * 1e3:.2f}" for b, s in zip(d["batches"], row, strict=True))
        print(f"{'decode':>15} ms by batch (context {context})  {cells}")
    lp = result["local_prefill"]
    cells = " ".join(f"{n}:{s * 1e3:.1f}" for n, s in zip(lp["tokens"], lp["extra_s"], strict=True))
    print(f"{'local prefill':>15} extra ms by tokens (batch {lp['batch']})  {cells}")
    print(f"load average: {result['load_average']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few points (CI smoke test)")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument(
        "--model",
        default="tiny",
        help="tiny or medium (pdserve.bench.support.models), or any model a node takes "
        "(smollm2, a GGUF file, a Hugging Face directory)",
    )
    p.add_argument("--max-batch", type=int, default=32, help="largest decode batch measured")
    p.add_argument("--repeats", type=int, default=None, help="per prompt length (default 3)")
    a = p.parse_args(argv)
    if a.max_batch < 1:
        p.error(f"--max-batch must be >= 1, got {a.max_batch}")
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    return a


def plan_points(a: argparse.Namespace, model: BenchModel) -> dict[str, Any]:
    """What each phase measures: fewer and smaller points with --quick."""
    room = model.max_context - 8
    lengths = [64, 256] if a.quick else [128, 256, 512, 1024, 2048, 4096]
    batches = [1, 4] if a.quick else [1, 2, 4, 8, 16, 32, 64]
    return {
        "lengths": sorted({min(n, room) for n in lengths}),
        "contexts": [64] if a.quick else [128, 1024],
        "batches": sorted({min(b, a.max_batch) for b in batches}),
        "decode_tokens": 12 if a.quick else 48,
        "chunk_sizes": [128] if a.quick else [64, 256, 512],
        "chunk_batch": 2 if a.quick else 4,
    }


async def measure(
    nodes: bench_nodes.RunningNodes, model: BenchModel, a: argparse.Namespace
) -> dict[str, Any]:
    pts = plan_points(a, model)
    total = len(pts["lengths"]) * a.repeats + len(pts["contexts"]) * len(pts["batches"]) + 1
    bar = tqdm(total=total, desc="profile", unit="point")
    await _one(nodes.target("decode"), [1] * 32, 2)  # warm-up: first forwards on every node
    await _one(nodes.target("colocated"), [2] * 32, 2)
    result = await prefill_and_transfer(nodes, model, pts["lengths"], a.repeats, bar)
    decode = nodes.target("decode")
    tokens = pts["decode_tokens"]
    result["decode"] = await decode_steps(
        decode, model, pts["contexts"], pts["batches"], tokens, bar
    )
    bar.set_postfix_str("local prefill on a decode node")
    step = float(np.interp(pts["chunk_batch"], pts["batches"], result["decode"]["step_s"][0]))
    result["local_prefill"] = await local_prefill(
        nodes.target("colocated"), model, pts["chunk_batch"], pts["chunk_sizes"], a.repeats, step
    )
    bar.update()
    bar.close()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    exit_on_sigterm()
    model = resolve(a.model, a.out / "models")
    start = load_average()
    with bench_nodes.running(specs(model), a.out / "logs" / "profile") as nodes:
        model = asyncio.run(described(model, nodes.target("decode")))
        measured = asyncio.run(measure(nodes, model, a))
    result = {
        "schema": PROFILE_SCHEMA,
        "version": PROFILE_VERSION,
        "model": {
            "name": model.name,
            "spec": model.spec,
            "max_context": model.max_context,
            "vocab_size": model.prompt_vocab,
        },
        "threads_per_node": 1,
        "chunk_tokens": EngineConfig.max_num_tokens,
        "prefill_budget_tokens": PREFILL_MAX_NUM_TOKENS,
        **measured,
        "environment": environment(),
        "load_average": {"start": start, "end": load_average()},
    }
    write_json(a.out / "profile.json", result)
    plot(result, a.out)
    print_summary(result)
    return result


if __name__ == "__main__":
    main()
