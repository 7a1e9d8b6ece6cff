"""vLLM's offline `LLM` on one engine workload, run with the vLLM venv's python (never pdserve's):

    VLLM_CPU_KVCACHE_SPACE=2 taskset -c 0-1 VENV/bin/python pdserve/bench/peers/vllm_engine.py \
        SPEC.json RESULT.json

SPEC.json: {"model", "dtype", "batch", "max_model_len", "max_num_tokens", "prompts" (token ids),
"max_tokens"}. RESULT.json: output tokens/s of the timed `generate` (start-up and one warm-up
request excluded) and every request's output token ids. A script file, not stdin: vLLM spawns its
engine core. Standalone: this file imports nothing of pdserve (another venv).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        enforce_eager=True,  # no triton-cpu here
        max_num_seqs=spec["batch"],
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_num_tokens"],
        seed=0,
    )
    startup = time.perf_counter() - started
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in spec["max_tokens"]
    ]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    write_result(result_path, "vllm", spec["max_tokens"], outputs, elapsed, startup)


def write_result(
    path: str,
    system: str,
    max_tokens: list[int],
    outputs: list[list[int]],
    elapsed: float,
    startup: float,
) -> None:
    """RESULT.json, the same for both systems (stdlib only: the pdserve side imports it too)."""
    if [len(o) for o in outputs] != max_tokens:
        raise RuntimeError(f"{system} returned a different number of tokens than asked for")
    result = {
        "system": system,
        "tokens_per_s": sum(max_tokens) / elapsed,
        "elapsed_s": elapsed,
        "startup_s": startup,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "outputs": outputs,
    }
    with open(path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
