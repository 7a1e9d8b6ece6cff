"""Sampler cost at batch 32: penalties + logit_bias + min_tokens + logprobs on vs off.

Runs the colocated engine with 32 requests decoding at once and times every `step()` and, inside
it, every sampler call (`Sampler.sample_step`). "off" is temperature sampling with top-k/top-p
only; "on" adds repetition/presence/frequency penalties, a 20-entry logit_bias, min_tokens and
logprobs=5 to every request. Models: the tiny byte model (vocab 259) and a checkpoint with
SmolLM2-135M's shapes (vocab 49152, 30 layers; random weights: the cost is the shapes').
The target: the sampler's extra time with everything on is <= 10% of a decode step.

    python -m pdserve.bench.sampler [--quick] [--out bench_out]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.support.util import environment, write_json
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model

BATCH = 32
SMOLLM2_SHAPES = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
TARGET = 0.10


def params(on: bool, vocab: int, seed: int) -> SamplingParams:
    base = SamplingParams(
        max_tokens=512, temperature=0.8, top_k=50, top_p=0.95, seed=seed, ignore_eos=True
    )
    if not on:
        return base
    bias = {(seed * 7 + i * 13) % vocab: 1.0 for i in range(20)}
    return replace(
        base,
        logit_bias=bias,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        min_tokens=8,
        logprobs=5,
    )


def measure(spec: str, on: bool, steps: int) -> dict[str, float]:
    llm = LLM(
        EngineConfig(model=spec, num_kv_blocks=2048, max_batch_size=BATCH, device="cpu"),
        load_model(spec),
    )
    vocab = llm.core.model_config.vocab_size
    for i in range(BATCH):
        llm.add_request([3 + (i * 31 + j) % 200 for j in range(32)], params(on, vocab, i))
    sampler = llm.core.sampler
    inner = sampler.sample_step
    sample_times: list[float] = []

    def timed(*args: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*args)
        sample_times.append(time.perf_counter() - t0)
        return out

    sampler.sample_step = timed  # type: ignore[method-assign]
    while any(not r.output_token_ids for r in llm.core.requests.values()):  # prefills done
        llm.step()
    sample_times.clear()
    step_times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.step()
        step_times.append(time.perf_counter() - t0)
    for rid in list(llm.core.requests):
        llm.core.abort(rid)
    llm.check_conservation()
    return {
        "step_ms": 1e3 * statistics.median(step_times),
        "sampler_ms": 1e3 * statistics.median(sample_times),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)"
    )
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per run")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    steps = 5 if args.quick else args.steps
    load_start = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny": "tiny"}
        if not args.quick:
            from pdserve.bench.support.checkpoints import build_checkpoint

            path = build_checkpoint("llama", Path(tmp) / "smollm2-shapes", **SMOLLM2_SHAPES)
            models["smollm2_135m_shapes"] = str(path)
        for name, spec in models.items():
            off, on = measure(spec, False, steps), measure(spec, True, steps)
            extra = on["sampler_ms"] - off["sampler_ms"]
            rows.append(
                {
                    "model": name,
                    "batch": BATCH,
                    "off": off,
                    "on": on,
                    "sampler_extra_ms": extra,
                    "sampler_extra_over_decode_step": extra / off["step_ms"],
                    "sampler_on_over_decode_step": on["sampler_ms"] / on["step_ms"],
                }
            )
            print(rows[-1])
    result = {
        "benchmark": "sampler",
        "environment": environment(),
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "rows": rows,
        "target_extra_over_step": TARGET,
        "meets_target": all(r["sampler_extra_over_decode_step"] <= TARGET for r in rows),
    }
    write_json(args.out / "sampler.json", result)
    return result


if __name__ == "__main__":
    main()
