"""Phase 1 of `pdserve bench peer`: the offline engines, pdserve's `LLM` against vLLM's `LLM`.

Each run is a fresh process under `taskset -c CORES` (the same cores for both systems) that loads
the model, serves one warm-up request, then times one `generate` of the whole workload; runs of
the two systems alternate (the order flips from one pair of runs to the next) so that the load of
this shared machine drifts over both alike; with `--pairs N` each row is N such pairs and its
ratio the median of theirs. Greedy outputs are compared token for token.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pdserve.bench.support.util import REPO_ROOT, child_env, load_average

DRIVERS = {
    "pdserve": ["-m", "pdserve.bench.peers.vllm_pdserve_engine"],
    "vllm": [str(REPO_ROOT / "pdserve" / "bench" / "peers" / "vllm_engine.py")],
}
RUN_TIMEOUT_S = 1800


@dataclass(frozen=True)
class EngineWorkload:
    requests: int = 64
    prompt_range: tuple[int, int] = (16, 512)
    output_range: tuple[int, int] = (8, 128)
    max_model_len: int = 1024
    max_num_tokens: int = 1024  # per-step token budget of both engines (chunked prefill)
    kv_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE (whole GiB) and pdserve's KV pool alike
    seed: int = 0


def workload(w: EngineWorkload, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Random prompt token ids (ids 3.. skip BOS/EOS/pad) and output lengths, seeded."""
    rng = random.Random(w.seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(*w.prompt_range))]
        for _ in range(w.requests)
    ]
    return prompts, [rng.randint(*w.output_range) for _ in range(w.requests)]


def run_one(
    system: str, spec: dict[str, Any], cores: str, vllm_python: Path, work: Path
) -> dict[str, Any]:
    """One timed generate in a fresh process pinned to `cores`; its RESULT.json."""
    work.mkdir(parents=True, exist_ok=True)
    tag = f"{system}-{spec['dtype']}-b{spec['batch']}"
    spec_path, result_path = work / f"{tag}.spec.json", work / f"{tag}.result.json"
    spec_path.write_text(json.dumps(spec))
    python = str(vllm_python) if system == "vllm" else sys.executable
    cmd = ["taskset", "-c", cores, python, *DRIVERS[system], str(spec_path), str(result_path)]
    env = child_env(
        VLLM_CPU_KVCACHE_SPACE=str(spec["kv_gib"]),
        VLLM_CPU_OMP_THREADS_BIND=cores,
        OMP_NUM_THREADS=str(len(os.sched_getaffinity(0) & cpu_set(cores))),
    )
    if system == "vllm":
        env.pop("PYTHONPATH", None)  # vLLM's venv must not see pdserve's packages
    log_path = work / f"{tag}.log"
    with open(log_path, "w") as log:
        code = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=RUN_TIMEOUT_S
        ).returncode
    if code != 0:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{system} engine run failed ({code}); {log_path} ends:\n{tail}")
    return json.loads(result_path.read_text())


def cpu_set(cores: str) -> set[int]:
    """'0-1,3' -> {0, 1, 3} (taskset's list syntax)."""
    out: set[int] = set()
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many outputs are token-identical, and the mean length of the common prefix."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = []
    for x, y in zip(a, b, strict=True):
        n = next(
            (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y))
        )
        prefix.append(n / max(1, len(x)))
    return {"identical": same, "of": len(a), "mean_common_prefix_fraction": sum(prefix) / len(a)}


def run_phase(
    model_dir: Path,
    vocab: int,
    vllm_python: Path,
    cores: str,
    dtypes: list[str],
    batches: dict[int, int],
    w: EngineWorkload,
    work: Path,
    pairs: int = 1,
) -> list[dict[str, Any]]:
    """`batches`: batch limit -> number of requests (a prefix of the same workload). `pairs`:
    runs of each system per row, alternating; the row's ratio is the median of each pair's own
    ratio (a slow spell of this shared VM then falls on one pair, not on one system)."""
    prompts, outputs = workload(w, vocab)
    rows = []
    plan = [(d, b) for d in dtypes for b in batches]
    bar = tqdm(total=2 * pairs * len(plan), desc="engine runs", unit="run")
    for i, (dtype, batch) in enumerate(plan):
        n = batches[batch]
        spec = {
            "model": str(model_dir),
            "dtype": dtype,
            "batch": batch,
            "max_model_len": w.max_model_len,
            "max_num_tokens": w.max_num_tokens,
            "kv_gib": w.kv_gib,
            "prompts": prompts[:n],
            "max_tokens": outputs[:n],
        }
        before = load_average()
        runs = []
        for pair in range(pairs):
            order = ["pdserve", "vllm"] if (i + pair) % 2 == 0 else ["vllm", "pdserve"]
            got: dict[str, dict[str, Any]] = {}
            for system in order:
                got[system] = run_one(system, spec, cores, vllm_python, work)
                bar.update(1)
            runs.append((order, got))
        row = _row(dtype, batch, n, runs)
        row["load_average_before"], row["load_average_after"] = before, load_average()
        rows.append(row)
        pair_ratios = " ".join(f"{r:.2f}" for r in row["pair_ratios"])
        tqdm.write(
            f"{dtype:>8} batch {batch:>2} ({n} req): pdserve {row['pdserve_tokens_per_s']:7.1f}"
            f" tok/s  vllm {row['vllm_tokens_per_s']:7.1f} tok/s  ratio {row['ratio']:.2f}x"
            f" (pairs {pair_ratios})  identical {row['agreement']['identical']}/{n}"
            f"  load {before[0]}"
        )
    bar.close()
    return rows


def _row(
    dtype: str, batch: int, n: int, runs: list[tuple[list[str], dict[str, dict[str, Any]]]]
) -> dict[str, Any]:
    """One table row from a row's pairs of runs: medians, and every pair's numbers."""
    ours = [got["pdserve"]["tokens_per_s"] for _, got in runs]
    theirs = [got["vllm"]["tokens_per_s"] for _, got in runs]
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    first = runs[0][1]
    return {
        "dtype": dtype,
        "max_batch_size": batch,
        "requests": n,
        "order": runs[0][0],
        "pdserve_tokens_per_s": statistics.median(ours),
        "vllm_tokens_per_s": statistics.median(theirs),
        "ratio": statistics.median(ratios),
        "pair_ratios": ratios,
        "pair_tokens_per_s": {"pdserve": ours, "vllm": theirs},
        "startup_s": {s: first[s]["startup_s"] for s in first},
        "agreement": agreement(first["pdserve"]["outputs"], first["vllm"]["outputs"]),
    }
