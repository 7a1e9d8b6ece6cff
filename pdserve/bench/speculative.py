"""Speculative decoding (n-gram prompt lookup) against plain decoding, same engine, same run.

    pdserve bench speculative [--model smollm2] [--quick] [--out bench_out]

The workload is one where prompt lookup can work: a chat request to repeat a given text
exactly (quoting, rewriting, code edits copy most of their input). Each request's inter-token
latency is its decode time over its tokens after the first; the report gives the p50 over
requests with and without `--speculative-config`, at batch 1 (one request at a time) and with
`--batch` requests at once, and their ratio. Both engines load the same weights once each and
alternate, so drift on a noisy machine falls on both. Writes JSON and a PNG to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from pdserve.bench.support.util import bar_plot, environment, load_average, write_json
from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.speculative.config import SpeculativeConfig

# the text to repeat: this module's own source (no download; varied code and prose)
TEXT = Path(__file__).read_text()


def quoting_prompts(core: EngineCore, count: int, chars: int) -> list[list[int]]:
    """`count` requests to repeat a different slice of TEXT, through the model's template."""
    template = core.loaded.chat_template
    prompts = []
    for i in range(count):
        start = (i * 397) % max(1, len(TEXT) - chars)
        passage = TEXT[start : start + chars]
        ask = f"Repeat the following text exactly, and nothing else:\n\n{passage}"
        if template is None:
            prompts.append(core.tokenizer.encode(ask))
            continue
        rendered = template.render([{"role": "user", "content": ask}], add_generation_prompt=True)
        prompts.append(core.tokenizer.encode(rendered, add_special_tokens=False))
    return prompts


def itl_p50(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Run the prompts at once; p50 over requests of (last token - first token) / (tokens - 1)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    deltas_seen = 0  # one per request per step that yielded it tokens
    for i, prompt in enumerate(prompts):
        core.add_request(prompt, params, f"q{i}")
    while core.has_work:
        deltas = core.step()
        now = time.perf_counter()
        deltas_seen += len(deltas)
        for d in deltas:
            first.setdefault(d.request_id, now)
            last[d.request_id] = now
            count[d.request_id] = count.get(d.request_id, 0) + len(d.token_ids)
    core.check_conservation()
    itls = [(last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1]
    return {
        "itl_p50_s": statistics.median(itls),
        "tokens_per_step": sum(count.values()) / max(1, deltas_seen),  # per request
    }


def measure(
    engines: dict[str, EngineCore],
    prompts: list[list[int]],
    batch: int,
    max_tokens: int,
    repeats: int = 1,
) -> dict[str, dict[str, float]]:
    """Both engines over the same prompts, `batch` at a time, alternating per group and
    swapping which goes first each time (a burst of other work on a shared machine then falls
    on either), each group `repeats` times; medians over the groups."""
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)] * repeats
    for core in engines.values():  # untimed: a batch's first run pays first-touch page faults
        itl_p50(core, groups[0], max_tokens)
    for n, group in enumerate(tqdm(groups, desc=f"batch {batch}", unit="group")):
        order = list(engines.items())
        for name, core in order if n % 2 == 0 else reversed(order):
            samples[name].append(itl_p50(core, group, max_tokens))
    return {
        name: {
            "itl_p50_s": statistics.median(s["itl_p50_s"] for s in runs),
            "tokens_per_step": statistics.fmean(s["tokens_per_step"] for s in runs),
        }
        for name, runs in samples.items()
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--quick", action="store_true", help="tiny model, few tokens (CI smoke)")
    parser.add_argument("--batch", type=int, default=32, help="the larger batch measured")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--requests", type=int, default=8, help="requests at batch 1")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument(
        "--repeats", type=int, default=4, help="runs of the larger batch, engines alternating"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    a = parser.parse_args(argv)
    model = "tiny" if a.quick else a.model
    requests, chars, max_tokens = (4, 200, 16) if a.quick else (a.requests, 600, a.max_tokens)
    batch = min(a.batch, 4) if a.quick else a.batch
    repeats = 2 if a.quick else a.repeats
    spec = SpeculativeConfig(num_speculative_tokens=a.k, prompt_lookup_max=4)
    base = EngineConfig(model=model, max_batch_size=max(batch, 1), max_num_tokens=8192)
    engines = {
        "plain": EngineCore(base, role=DecodeSettings()),
        "ngram": EngineCore(replace(base, speculative=spec), role=DecodeSettings()),
    }
    prompts = quoting_prompts(engines["plain"], max(requests, batch), chars)
    rows = []
    for size in (1, batch):
        subset = prompts[: requests if size == 1 else batch]
        got = measure(engines, subset, size, max_tokens, 1 if size == 1 else repeats)
        ratio = got["ngram"]["itl_p50_s"] / got["plain"]["itl_p50_s"]
        rows.append({"batch": size, **got, "itl_ratio": ratio})
        tqdm.write(
            f"batch {size:>3}: ITL p50 plain {got['plain']['itl_p50_s'] * 1e3:7.1f} ms  ngram "
            f"{got['ngram']['itl_p50_s'] * 1e3:7.1f} ms  ratio {ratio:.2f}x  tokens/step "
            f"{got['ngram']['tokens_per_step']:.2f}"
        )
    result = {
        "benchmark": "speculative_ngram",
        "model": model,
        "speculative": {"num_speculative_tokens": a.k, "prompt_lookup_max": 4},
        "max_tokens": max_tokens,
        "repeats": repeats,
        "environment": {**environment(), "load_average": load_average(), "cpus": os.cpu_count()},
        "rows": rows,
    }
    write_json(a.out / "speculative.json", result)
    bar_plot(
        a.out / "speculative.png",
        "Inter-token latency p50: n-gram speculative vs plain decoding",
        [f"batch {r['batch']}" for r in rows],
        {
            "plain": [r["plain"]["itl_p50_s"] * 1e3 for r in rows],
            "ngram": [r["ngram"]["itl_p50_s"] * 1e3 for r in rows],
        },
        "ms per token",
    )
    return result


if __name__ == "__main__":
    main()
