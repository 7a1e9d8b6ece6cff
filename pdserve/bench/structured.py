"""What structured outputs cost: decode tokens/s of a batch under a JSON-schema constraint vs the
same batch unconstrained (same run, same prompts; target >= 0.9x), and the time to first token
of a constrained request whose grammar is compiled cold vs found in the cache.

Decode is timed from the step every request has its first token to the last step (prefill
excluded); each request makes exactly `--tokens` tokens (the schema is longer than that, so a
constrained request ends on its length, as the unconstrained one does with ignore_eos). Runs
alternate free/constrained `--repeats` times and the best of each counts (a shared machine's
noise only ever slows a run down).

    pdserve bench structured [--quick] [--model smollm2] [--out bench_out]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pdserve.bench.support.util import bar_plot, environment, load_average, write_json
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.sampling.structured_output import StructuredOutput

TARGET_RATIO = 0.9


def long_schema(tag: str = "") -> dict[str, Any]:
    """An array of 64 small records: more tokens than any run asks for; `tag` (an extra enum
    value) makes a schema, and so its grammar, new to the cache."""
    record = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z]{3,8}$"},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "kind": {"enum": ["a", "b", "c", *([tag] if tag else [])]},
        },
        "required": ["name", "n", "kind"],
        "additionalProperties": False,
    }
    return {"type": "array", "items": record, "minItems": 64, "maxItems": 64}


def spec(tag: str = "") -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(long_schema(tag)))


def decode_rate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    """Decode tokens/s of the whole batch: from every request's first token to the last."""
    ids = [llm.add_request(p, params).request_id for p in prompts]
    started: set[str] = set()
    t_first = t_end = 0.0
    decoded = 0
    while llm.core.has_work:
        deltas = llm.step()
        now = time.perf_counter()
        if len(started) == len(ids):  # every request had its first token before this step
            decoded += sum(len(d.token_ids) for d in deltas)
        else:
            started.update(d.request_id for d in deltas)
            t_first = now
        t_end = now
    llm.check_conservation()
    return {"tokens_per_s": decoded / (t_end - t_first), "decoded_tokens": decoded}


def ttft(llm: LLM, prompt: list[int], params: SamplingParams) -> float:
    """Seconds from adding a one-token request to its token (a grammar compiled on the way)."""
    start = time.perf_counter()
    llm.add_request(prompt, params)
    while llm.core.has_work:
        if llm.step():
            elapsed = time.perf_counter() - start
            while llm.core.has_work:
                llm.step()
            return elapsed
    raise RuntimeError("the request produced no token")


def measure_ttft(llm: LLM, prompt: list[int], trials: int) -> dict[str, float]:
    one = SamplingParams(max_tokens=1, temperature=0.0)
    ttft(llm, prompt, SamplingParams(max_tokens=1, structured=spec("warm")))  # the compiler
    free, cold, cached = [], [], []
    for _ in range(trials):
        fresh = spec(uuid.uuid4().hex[:8])
        free.append(ttft(llm, prompt, one))
        cold.append(ttft(llm, prompt, SamplingParams(max_tokens=1, structured=fresh)))
        cached.append(ttft(llm, prompt, SamplingParams(max_tokens=1, structured=fresh)))
    llm.check_conservation()
    median = statistics.median
    return {
        "free_s": median(free),
        "cold_grammar_s": median(cold),
        "cached_grammar_s": median(cached),
        "cold_over_cached": median(cold) / median(cached),
        "trials": trials,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and batch (smoke test)")
    parser.add_argument("--model", default=None, help="default: smollm2 (--quick: tiny)")
    parser.add_argument("--batch", type=int, default=None, help="default 32 (--quick: 4)")
    parser.add_argument("--tokens", type=int, default=None, help="default 128 (--quick: 8)")
    parser.add_argument("--repeats", type=int, default=None, help="default 2 (--quick: 1)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    a = parser.parse_args(argv)
    model = a.model or ("tiny" if a.quick else "smollm2")
    batch = a.batch or (4 if a.quick else 32)
    tokens = a.tokens or (8 if a.quick else 128)
    repeats = a.repeats or (1 if a.quick else 2)
    llm = LLM(EngineConfig(model=model, num_kv_blocks=4096, max_batch_size=batch))
    prompts = [llm.encode(f"Record {i}: list the inventory as JSON.") for i in range(batch)]
    free = SamplingParams(max_tokens=tokens, temperature=0.8, seed=1, ignore_eos=True)
    constrained = SamplingParams(max_tokens=tokens, temperature=0.8, seed=1, structured=spec())
    decode_rate(llm, prompts, constrained)  # warm-up: first steps, the grammar compiled
    load_start = load_average()
    runs: dict[str, list[dict[str, float]]] = {"free": [], "json_schema": []}
    for _ in tqdm(range(repeats), desc="free / constrained", unit="pair"):
        runs["free"].append(decode_rate(llm, prompts, free))
        runs["json_schema"].append(decode_rate(llm, prompts, constrained))
    best = {k: max(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    ratio = best["json_schema"] / best["free"]
    latency = measure_ttft(llm, prompts[0], 2 if a.quick else 8)
    result = {
        "benchmark": "structured_outputs",
        "model": model,
        "batch": batch,
        "tokens_per_request": tokens,
        "decode_tokens_per_s": best,
        "runs": runs,
        "ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        "ttft": latency,
        "load_average": {"start": load_start, "end": load_average()},
        "environment": environment(),
    }
    print(
        f"decode at batch {batch}: free {best['free']:.1f} tok/s, json_schema "
        f"{best['json_schema']:.1f} tok/s, ratio {ratio:.2f}x (target >= {TARGET_RATIO}x)\n"
        f"TTFT: free {latency['free_s'] * 1e3:.1f} ms, cold grammar "
        f"{latency['cold_grammar_s'] * 1e3:.1f} ms, cached grammar "
        f"{latency['cached_grammar_s'] * 1e3:.1f} ms ({latency['cold_over_cached']:.1f}x)\n"
        f"load average {load_start} -> {result['load_average']['end']}"
    )
    write_json(a.out / "structured_outputs.json", result)
    bar_plot(
        a.out / "structured_outputs.png",
        f"Decode tokens/s at batch {batch}: free vs JSON schema ({model})",
        ["decode"],
        {"free": [best["free"]], "json_schema": [best["json_schema"]]},
        "decode tokens / s",
    )
    return result


if __name__ == "__main__":
    main()
