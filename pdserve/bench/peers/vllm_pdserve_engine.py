"""pdserve's offline `LLM` on the same engine workload as pdserve/bench/peers/vllm_engine.py (same
SPEC.json in, same RESULT.json out), run in pdserve's environment under the same `taskset`:

    taskset -c 0-1 python -m pdserve.bench.peers.vllm_pdserve_engine SPEC.json RESULT.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from pdserve.bench.peers.vllm_engine import write_result
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # every core taskset gave us
    started = time.perf_counter()
    llm = LLM(
        EngineConfig(
            model=spec["model"],
            dtype=spec["dtype"],
            device="cpu",
            max_batch_size=spec["batch"],
            max_model_len=spec["max_model_len"],
            max_num_tokens=spec["max_num_tokens"],
            kv_cache_memory_mb=int(spec["kv_gib"] * 1024),
        )
    )
    startup = time.perf_counter() - started
    llm.generate(spec["prompts"][:1], SamplingParams(max_tokens=4, ignore_eos=True))
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in spec["max_tokens"]]
    start = time.perf_counter()
    outs = llm.generate(spec["prompts"], params)
    elapsed = time.perf_counter() - start
    llm.check_conservation()
    outputs = [list(o.token_ids) for o in outs]
    write_result(result_path, "pdserve", spec["max_tokens"], outputs, elapsed, startup)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
