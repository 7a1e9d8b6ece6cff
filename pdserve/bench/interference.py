"""The interference experiment of `pdserve bench serve` (DistServe's): a few short-prompt,
long-output requests decode steadily; their ITL p99 is measured alone, then again while long
prompts arrive. P/D should keep it (prefill runs on another node), colocated should not (long
prefill chunks share the decode steps).

One phase pair lasts a few seconds, so each p99 rests on the ~40 slowest of a few thousand
gaps, and on a 2-core machine one descheduling of the decode node or the client moves it by
20-40% (docs/performance.md, "Decode ITL under long-prompt arrivals"). So the pair runs
`--interference-rounds` times, alone and loaded alternating (a drift of the machine's load hits
both alike), and the ratio is taken between the pooled gaps of all rounds; each round's own
ratio is reported beside it.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from tqdm import tqdm

from pdserve.bench.support.load import RequestRecord, RequestSpec, random_prompts, run_requests
from pdserve.bench.support.models import BenchModel
from pdserve.bench.support.util import ratio, summarize

KEYS = [
    "decode_streams",
    "decode_input_len",
    "decode_output_len",
    "long_prompts",
    "long_input_len",
    "interference_rounds",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("interference experiment")
    g.add_argument("--no-interference", action="store_true")
    g.add_argument("--decode-streams", type=int, default=None)
    g.add_argument("--decode-input-len", type=int, default=32)
    g.add_argument("--decode-output-len", type=int, default=None)
    g.add_argument("--long-prompts", type=int, default=None)
    g.add_argument("--long-input-len", type=int, default=None)
    g.add_argument(
        "--interference-rounds",
        type=int,
        default=None,
        help="alone / with-long-prompts phase pairs, alternating; p99s pool their gaps",
    )


def decode_streams(a: argparse.Namespace, model: BenchModel, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    prompts = random_prompts(a.decode_streams, a.decode_input_len, model.prompt_vocab, rng)
    return [RequestSpec(p, a.decode_output_len, 0.0, "decode") for p in prompts]


def long_prompts(
    a: argparse.Namespace, model: BenchModel, window: float, seed: int
) -> list[RequestSpec]:
    """`--long-prompts` prompts arriving at random inside the first 60% of the decode streams'
    quiet lifetime, so that their prefills (and, for P/D, their KV pushes) land while the
    streams still decode."""
    rng = np.random.default_rng(seed)
    n = a.long_prompts
    prompts = random_prompts(n, a.long_input_len, model.prompt_vocab, rng)
    offsets = sorted(rng.uniform(0.05 * window, 0.6 * window, size=n))
    return [RequestSpec(p, 4, float(t), "long") for p, t in zip(prompts, offsets, strict=True)]


def itl_of(records: list[RequestRecord], group: str) -> list[float]:
    return [gap for r in records if r.ok and r.spec.group == group for gap in r.itls]


async def interference(
    target: str, a: argparse.Namespace, model: BenchModel, bar: tqdm
) -> dict[str, Any]:
    """Decode ITL alone, then with long prompts arriving, `a.interference_rounds` times; every
    phase has fresh prompts (no prefix-cache help). Round 0's seeds are the single-round
    experiment's."""
    quiet_gaps: list[float] = []
    loaded_gaps: list[float] = []
    rounds: list[dict[str, Any]] = []
    records: list[RequestRecord] = []
    for k in range(a.interference_rounds):
        bar.set_postfix_str(f"interference {k + 1}/{a.interference_rounds}: decode alone")
        quiet, quiet_s = await run_requests(target, decode_streams(a, model, 1 + 10 * k))
        bar.set_postfix_str(f"interference {k + 1}/{a.interference_rounds}: with long prompts")
        specs = decode_streams(a, model, 2 + 10 * k) + long_prompts(a, model, quiet_s, 3 + 10 * k)
        mixed, mixed_s = await run_requests(target, specs)
        records += quiet + mixed
        alone, loaded = itl_of(quiet, "decode"), itl_of(mixed, "decode")
        quiet_gaps += alone
        loaded_gaps += loaded
        p99s = summarize(alone)["p99"], summarize(loaded)["p99"]
        rounds.append(
            {
                "p99_alone_s": p99s[0],
                "p99_loaded_s": p99s[1],
                "p99_ratio": ratio(p99s[1], p99s[0]),
                "durations_s": {"alone": quiet_s, "with_long_prompts": mixed_s},
            }
        )
        if k == 0:
            timeline = _timeline(mixed)
    base, loaded_all = summarize(quiet_gaps), summarize(loaded_gaps)
    longs = [r for r in records if r.spec.group == "long" and r.ok]
    return {
        "decode_itl_alone_s": base,
        "decode_itl_with_long_prompts_s": loaded_all,
        "p99_ratio": ratio(loaded_all["p99"], base["p99"]),
        "rounds": rounds,
        "long_prompt_ttft_s": summarize([r.ttft for r in longs]),
        "failed": sum(1 for r in records if not r.ok),
        "timeline": timeline,
    }


def _timeline(records: list[RequestRecord]) -> dict[str, Any]:
    """Per-token gaps of the decode streams over time, and when the long prompts arrived (for
    the plot)."""
    t0 = min(r.start for r in records)
    points = [
        (b - t0, b - a)
        for r in records
        if r.ok and r.spec.group == "decode"
        for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)
    ]
    arrivals = [r.start - t0 for r in records if r.spec.group == "long"]
    return {"t_s": [p[0] for p in points], "itl_s": [p[1] for p in points], "long_at_s": arrivals}
