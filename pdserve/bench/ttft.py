"""Time to first token, broken down: P/D (layer-wise and whole-request push) vs colocated.

One prefill node (core 0) serves two decode nodes (core 1): one asks for layer-wise pushes, one
for whole-request pushes; a colocated node (`pdserve colocated`) runs on core 1 too. The decode
nodes run with their defaults, conditional (local) prefill included. Every node has one torch
thread, so a prompt's prefill gets the same core in every mode. Requests go one at a time (an
idle system: TTFT without queueing), the three modes round-robin per prompt length and repeat,
every prompt distinct (no prefix-cache hits).

Per request: client TTFT; the node's own breakdown (queue on the prefill node, prefill compute,
transfer tail = last layer computed -> last KV byte sent, as the prefill node reports it); the
residual (node TTFT minus those: the Prefill RPC hop, admission, landing the first token); the
first decode step (client gap between tokens 1 and 2). Headlines: tail / prefill, and P/D TTFT /
colocated TTFT (the median of each repeat's ratio; the ratio of the medians beside it).

    python -m pdserve.bench.ttft [--quick] [--models tiny,medium] [--out bench_out]
    pdserve bench ttft ...
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from decode_node.push_mode import pushes_layerwise
from pdserve.bench.support import nodes as bench_nodes
from pdserve.bench.support.load import RequestRecord, RequestSpec, random_prompts, stream_request
from pdserve.bench.support.models import BenchModel, resolve
from pdserve.bench.support.util import (
    environment,
    exit_on_sigterm,
    figure,
    load_average,
    pyplot,
    ratio,
    write_json,
)

MODES = {"pd_layerwise": "decode", "pd_whole": "decode-whole", "colocated": "colocated"}
# the push a decode node picks by default (--push auto) for this setup, a prefill node on the
# same host pushing into CPU pools: the mode the default-push target reads
DEFAULT_PUSH = (
    "pd_layerwise" if pushes_layerwise("auto", "127.0.0.1:50052", kv_on_cpu=True) else "pd_whole"
)
FULL_LENGTHS = [16, 64, 256, 1024, 2048, 4096, 8192]
QUICK_LENGTHS = [128, 256]
OUTPUT_TOKENS = 4  # the first token, then three decode steps
TAIL_TARGET = 0.10  # tail <= 10% of prefill compute ...
TAIL_TARGET_MIN_LEN = 1024  # ... for prompts of at least this many tokens
TTFT_TARGET = 1.10  # P/D TTFT <= 1.1x colocated (the push design, prompts >= 1k) ...
CONDITIONAL_TARGET = 1.05  # ... and <= 1.05x at every length with conditional prefill
# A short prompt's TTFT is 4-20 ms, where one request scatters +-15% between runs: the median
# of 5 repeats cannot resolve a 5% bound, the median of 15 can (2026-12-01: 0.97-1.04 at
# 16-1k tokens, the same computation in every mode).
FULL_REPS = 15
SHORT_PROMPT = 4096  # prompts below this get SHORT_PROMPT // tokens x the repeats (capped)
# At 16-64 tokens one request's TTFT (5-11 ms) has an interquartile range of ~3 ms on these VMs
# (measured 2026-12-02): the median of 60 moved +-0.4 ms between identical processes,
# i.e. +-5% of the ratio, so rows of identical computation read 0.96-1.08 (and 1.08 at 2k
# tokens from 15 repeats). Up to 16x (240 repeats, ~10 s a short row) halves that.
MAX_REPEAT_FACTOR = 16


def repeats(tokens: int, reps: int) -> int:
    """Repeats for one prompt length: `reps`, times up to MAX_REPEAT_FACTOR for short prompts."""
    return reps * max(1, min(MAX_REPEAT_FACTOR, SHORT_PROMPT // max(tokens, 1)))


COMPONENTS = ["queue", "prefill", "tail", "other"]
TAIL_NOTE = (
    "tail is the prefill node's transfer_tail_seconds: from the layer hook of the last layer "
    "(fired when that layer's K/V are written, before its attention, MLP and the LM head run) "
    "to the last KV byte sent; it therefore includes that remaining compute, and prefill "
    "(to the first token) overlaps it, which is why 'other' goes negative"
)


def lengths_for(model: BenchModel, wanted: list[int]) -> tuple[list[int], str | None]:
    """Prompt lengths that fit the model's context with the output tokens; the longest that
    does not fit is replaced by the longest that does (tiny's context is 4096)."""
    room = model.max_context - OUTPUT_TOKENS
    fits = [n for n in wanted if n <= room]
    if len(fits) == len(wanted):
        return fits, None
    longest = sorted({*fits, room})
    return longest, f"{model.name}: context {model.max_context}, lengths > {room} -> {room}"


def breakdown(record: RequestRecord) -> dict[str, float]:
    t = record.timing
    node_ttft = t.get("ttft", 0.0)
    parts = {"queue": t.get("queue", 0.0), "prefill": t.get("prefill", 0.0)}
    parts["tail"] = t.get("kv_transfer", 0.0)
    parts["other"] = node_ttft - sum(parts.values())
    gaps = record.itls
    return {
        **parts,
        "node_ttft": node_ttft,
        "client_ttft": record.ttft,
        "first_decode_step": gaps[0] if gaps else 0.0,
    }


async def measure(
    nodes: bench_nodes.RunningNodes,
    model: BenchModel,
    lengths: list[int],
    reps: int,
    bar: tqdm,
) -> list[dict[str, Any]]:
    from pdserve.client import create_channel

    rng = np.random.default_rng(0)
    channels = {mode: create_channel(nodes.target(node)) for mode, node in MODES.items()}
    samples: list[dict[str, Any]] = []
    try:
        for channel in channels.values():  # warm-up: connections, first-call paths
            for prompt in random_prompts(2, 64, model.prompt_vocab, rng):
                await stream_request(channel, RequestSpec(prompt, OUTPUT_TOKENS), 600)
        order = list(MODES)
        for rep in range(max(repeats(n, reps) for n in lengths)):
            for n in (n for n in lengths if rep < repeats(n, reps)):
                for mode in order[rep % 3 :] + order[: rep % 3]:  # rotate: no mode always first
                    bar.set_postfix_str(f"{model.name} {n} tok {mode}")
                    prompt = random_prompts(1, n, model.prompt_vocab, rng)[0]
                    spec = RequestSpec(prompt, OUTPUT_TOKENS)
                    record = await stream_request(channels[mode], spec, 600)
                    if not record.ok:
                        raise RuntimeError(f"{mode} {n} tokens failed: {record.error}")
                    samples.append({"mode": mode, "tokens": n, "rep": rep, **breakdown(record)})
                    bar.update()
    finally:
        for channel in channels.values():
            await channel.close()
    return samples


def aggregate(model: str, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over repeats per (mode, length), and the headline ratios."""
    rows = []
    keys = [*COMPONENTS, "node_ttft", "client_ttft", "first_decode_step"]
    for n in sorted({s["tokens"] for s in samples}):
        row: dict[str, Any] = {"model": model, "tokens": n, "modes": {}}
        for mode in MODES:
            mine = [s for s in samples if s["mode"] == mode and s["tokens"] == n]
            row["modes"][mode] = {k: statistics.median(s[k] for s in mine) for k in keys}
        m = row["modes"]
        row["tail_over_prefill"] = {
            mode: ratio(m[mode]["tail"], m[mode]["prefill"]) or 0.0
            for mode in ("pd_layerwise", "pd_whole")
        }
        row["pd_over_colocated_ttft"] = {
            mode: paired_ratio(samples, n, mode) for mode in ("pd_layerwise", "pd_whole")
        }
        row["pd_over_colocated_ttft_of_medians"] = {
            mode: ratio(m[mode]["client_ttft"], m["colocated"]["client_ttft"])
            for mode in ("pd_layerwise", "pd_whole")
        }
        rows.append(row)
    return rows


def paired_ratio(samples: list[dict[str, Any]], tokens: int, mode: str) -> float | None:
    """Median over repeats of `mode`'s client TTFT ÷ the colocated one of the same repeat. A
    repeat runs the three modes back to back (order rotating), so a slow spell of the shared VM
    (seconds long) falls on all three of it; the ratio of two medians over the whole row does not
    cancel it (2026-12-02: identical computations read up to 1.08 that way, 1.00-1.03 paired)."""
    by_rep: dict[int, dict[str, float]] = {}
    for s in samples:
        if s["tokens"] == tokens and s["mode"] in (mode, "colocated"):
            by_rep.setdefault(s["rep"], {})[s["mode"]] = s["client_ttft"]
    pairs = [r[mode] / r["colocated"] for r in by_rep.values() if len(r) == 2 and r["colocated"]]
    return statistics.median(pairs) if pairs else None


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    long_rows = [r for r in rows if r["tokens"] >= TAIL_TARGET_MIN_LEN]
    tails = [r["tail_over_prefill"]["pd_layerwise"] for r in long_rows]
    ttft_all = [r["pd_over_colocated_ttft"]["pd_layerwise"] for r in rows]
    ttft_long = [r["pd_over_colocated_ttft"]["pd_layerwise"] for r in long_rows]
    both = [r["pd_over_colocated_ttft"][m] for r in rows for m in ("pd_layerwise", "pd_whole")]
    default = [r["pd_over_colocated_ttft"][DEFAULT_PUSH] for r in rows]

    def check(values: list[float | None], goal: float) -> dict[str, Any]:
        vals = [v for v in values if v is not None]
        worst = max(vals) if vals else None
        return {"worst": worst, "target": goal, "met": None if worst is None else worst <= goal}

    return {
        "layerwise_tail_le_10pct_prefill_ge_1k": check(tails, TAIL_TARGET),
        "pd_ttft_le_1_1x_colocated_all_lengths": check(ttft_all, TTFT_TARGET),
        "pd_ttft_le_1_1x_colocated_ge_1k": check(ttft_long, TTFT_TARGET),
        "pd_ttft_le_1_05x_colocated_all_lengths_default_push": check(default, CONDITIONAL_TARGET),
        "pd_ttft_le_1_05x_colocated_all_lengths_both_pushes": check(both, CONDITIONAL_TARGET),
    }


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    if pyplot() is None:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    colors = {"queue": "#999999", "prefill": "#4477aa", "tail": "#ee6677", "other": "#ccbb44"}
    with figure(out / "ttft.png", ncols=len(models), width=7.5) as (_, axes):
        for ax, model in zip(axes, models, strict=True):
            mine = [r for r in rows if r["model"] == model]
            width = 0.27
            for j, mode in enumerate(MODES):
                xs = np.arange(len(mine)) + (j - 1) * width
                bottom = np.zeros(len(mine))
                for part in COMPONENTS:
                    ys = np.array([max(0.0, r["modes"][mode][part]) * 1e3 for r in mine])
                    label = part if j == 0 else None
                    ax.bar(
                        xs,
                        ys,
                        width,
                        bottom=bottom,
                        color=colors[part],
                        label=label,
                        edgecolor="white",
                        linewidth=0.3,
                    )
                    bottom += ys
                client = [r["modes"][mode]["client_ttft"] * 1e3 for r in mine]
                marker = {"pd_layerwise": "o", "pd_whole": "s", "colocated": "^"}[mode]
                ax.plot(xs, client, marker, color="black", ms=4, label=f"client TTFT {mode}")
            ax.set_xticks(np.arange(len(mine)), [str(r["tokens"]) for r in mine])
            ax.set_yscale("log")
            ax.set_xlabel("prompt tokens (bars: P/D layer-wise | P/D whole | colocated)")
            ax.set_ylabel("ms")
            ax.set_title(f"TTFT breakdown, {model}")
            ax.legend(fontsize=6, ncol=2)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 lengths (CI)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument("--models", default=None, help="comma list of tiny, medium")
    parser.add_argument("--lengths", default=None, help="comma list of prompt lengths")
    parser.add_argument("--reps", type=int, default=0, help=f"0: 1 quick, {FULL_REPS} full")
    a = parser.parse_args(argv)
    exit_on_sigterm()
    models = (a.models or ("tiny" if a.quick else "tiny,medium")).split(",")
    wanted = [int(n) for n in a.lengths.split(",")] if a.lengths else None
    wanted = wanted or (QUICK_LENGTHS if a.quick else FULL_LENGTHS)
    reps = a.reps or (1 if a.quick else FULL_REPS)
    load_at_start = load_average()
    rows: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    notes: list[str] = []
    idle: dict[str, dict[str, float]] = {}
    resolved = [resolve(m, a.out / "models") for m in models]
    plans = [(m, *lengths_for(m, wanted)) for m in resolved]
    total = sum(repeats(n, reps) * len(MODES) for _, lengths, _ in plans for n in lengths)
    bar = tqdm(total=total, desc="ttft", unit="req")
    for model, lengths, note in plans:
        if note:
            notes.append(note)
        # on the decode nodes' core: a short prompt is prefilled there on both paths, so the
        # local rows compare the same engine on the same core. Listed first, it starts beside
        # the prefill node (core 0), before the decode nodes that wait for the prefill's port.
        specs = [bench_nodes.colocated_spec(model.spec, cpus=bench_nodes.core(1))]
        specs += bench_nodes.pd_specs(model.spec, whole_too=True)
        with bench_nodes.running(specs, a.out / "logs" / f"ttft_{model.name}") as nodes:
            idle[model.name] = nodes.idle_cpu(1.0 if a.quick else 3.0)
            got = asyncio.run(measure(nodes, model, lengths, reps, bar))
        samples += [{"model": model.name, **s} for s in got]
        rows += aggregate(model.name, got)
    bar.close()
    result = {
        "benchmark": "ttft",
        "environment": environment(),
        "load_average": {"start": load_at_start, "end": load_average()},
        "setup": "1 prefill node (core 0) shared by a layer-wise and a whole-request decode "
        "node (core 1); colocated node on core 1; one torch thread each; requests one at a "
        f"time, {OUTPUT_TOKENS} output tokens, medians of {reps} repeats (up to "
        f"{MAX_REPEAT_FACTOR * reps} below {SHORT_PROMPT} tokens: {SHORT_PROMPT}//tokens x)",
        "models": {m.name: {"spec": m.spec, "max_context": m.max_context} for m in resolved},
        "default_push": DEFAULT_PUSH,  # what --push auto picks in this setup
        "notes": [*notes, TAIL_NOTE],
        "idle_cpu_percent": idle,
        "rows": rows,
        "samples": samples,
        "targets": targets(rows),
    }
    write_json(a.out / "ttft.json", result)
    plot(rows, a.out)
    print_summary(result)
    return result


def print_summary(result: dict[str, Any]) -> None:
    print(
        f"{'model':>7} {'tokens':>6} {'prefill ms':>10} {'tail ms':>8} {'tail/pf':>8} "
        f"{'PD lw/col':>9} {'PD whole/col':>12}"
    )
    for r in result["rows"]:
        lw = r["modes"]["pd_layerwise"]
        pdc = r["pd_over_colocated_ttft"]
        print(
            f"{r['model']:>7} {r['tokens']:>6} {lw['prefill'] * 1e3:>10.1f} "
            f"{lw['tail'] * 1e3:>8.2f} {r['tail_over_prefill']['pd_layerwise']:>8.3f} "
            f"{pdc['pd_layerwise'] or 0:>9.2f} {pdc['pd_whole'] or 0:>12.2f}"
        )
    for name, check in result["targets"].items():
        print(f"  {name}: worst {check['worst']} (target {check['target']}) met={check['met']}")


if __name__ == "__main__":
    main()
