"""Where should a request preempted on a decode node get its KV back: recompute it locally, or
send it to a prefill node again? Measures, per context length, what each costs.

- local: the decode node's engine computes the whole context in its own batch (chunked at
  max_num_tokens), the way `Scheduler._preempt` re-queues it: one colocated prefill, timed.
- prefill node: a `Generate` of the same context through 1 prefill + 1 decode node, timed to the
  first token (Prefill RPC, the same prefill compute on the other node, the KV push, the hops):
  the least a trip back to a prefill node would cost.

    python -m pdserve.bench.preempt_recompute [--lengths 64,256,1024] [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from pdserve.bench.support.inprocess import pd_cluster
from pdserve.bench.support.load import random_prompts
from pdserve.bench.support.util import write_json
from pdserve.client import generate
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams


def local_recompute(model: str, prompt: list[int], reps: int) -> float:
    llm = LLM(EngineConfig(model=model, num_kv_blocks=1024, enable_prefix_caching=False))
    llm.generate([prompt], SamplingParams(max_tokens=1))  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def via_prefill_node(model: str, prompts: list[list[int]], reps: int) -> list[float]:
    cfg = EngineConfig(model=model, num_kv_blocks=1024, enable_prefix_caching=False)
    out = []
    async with pd_cluster(model, prefill_engine=cfg, decode_engine=cfg) as c:
        await generate(c.targets[0], prompts[0], max_tokens=1, timeout=60)  # warm-up
        for prompt in prompts:
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                await generate(c.targets[0], prompt, max_tokens=1, timeout=60)
                times.append(time.perf_counter() - start)
            out.append(statistics.median(times))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--lengths", default="64,256,1024")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="bench_out/preempt_recompute.json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)  # one core per role, as the nodes run
    lengths = [int(x) for x in a.lengths.split(",")]
    # ids from 3 up: clear of the tiny model's special tokens
    prompts = [random_prompts(1, n, 253, np.random.default_rng(n))[0] for n in lengths]
    prompts = [[t + 3 for t in p] for p in prompts]
    local = [local_recompute(a.model, prompt, a.reps) for prompt in prompts]
    remote = asyncio.run(via_prefill_node(a.model, prompts, a.reps))
    rows = [
        {"context_tokens": n, "local_s": lo, "prefill_node_s": re, "ratio": re / lo}
        for n, lo, re in zip(lengths, local, remote, strict=True)
    ]
    print(f"{'tokens':>7} {'local ms':>9} {'prefill node ms':>16} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['context_tokens']:>7} {r['local_s'] * 1e3:>9.2f} "
            f"{r['prefill_node_s'] * 1e3:>16.2f} {r['ratio']:>6.2f}"
        )
    write_json(Path(a.out), {"model": a.model, "reps": a.reps, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
