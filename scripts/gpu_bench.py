"""The GPU benchmark scripts/gpu-check runs (one short run, every ratio within it).

Sections, in order, each skipped with a row saying so when the time budget is spent:

* copy      device-to-device torch copy of 1 GiB (bytes copied per second);
* perftest  `ucx_perftest -t tag_bw -m cuda` between two processes on the GPU (the libucx wheel's
            binary), 64 MiB messages: the raw UCX ceiling for the KV push;
* decode    decode tokens/s on the SmolLM2-shaped model at batch 1/32/128, CUDA graphs on and
            off, against transformers' `generate` on the same weights;
* families  fp32 greedy parity of the newer families (Qwen3, Gemma 3), graphs on and off;
* pd        per model (SmolLM2-135M-shaped and a 1.1B Llama-shaped config, dummy weights written
            as a checkpoint here): one prefill and two decode processes on the GPU (layer-wise
            and whole-request push), one request at a time; TTFT broken down by the nodes'
            Timing (queue, prefill, transfer tail, other), and KV push GB/s = KV bytes /
            transfer time of the whole-request push (it starts after the last layer).

Writes --out/gpu_bench.json (`summary`: the rows gpu_check prints). `--dry-run` builds the plan
on CPU (configs parse, prompts fit, state-dict names) and prints it; `--smoke` runs everything
on CPU with tiny shapes (the plumbing, not the numbers).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the sibling modules (scripts/ is sys.path[0] when this file runs as a script)
from gpu_bench_families import families_section, families_summary  # noqa: E402
from gpu_bench_models import (  # noqa: E402
    DEVICE,
    MODELS,
    Budget,
    kv_bytes_per_token,
    param_shapes,
    prompt_ids,
    use_smoke,
    write_checkpoint,
)
from gpu_bench_pd import PROMPT_LENGTHS, REPS, pd_section, pd_summary  # noqa: E402

DECODE_BATCHES = [1, 32, 128]
DECODE = {"prompt": 64, "tokens": 64}
PERFTEST_BYTES = 64 * 2**20


# ---- bandwidth ------------------------------------------------------------------------------
def copy_bandwidth() -> float:
    import torch

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 20 * src.numel() / (start.elapsed_time(end) / 1e3) / 1e9


def perftest_binary() -> Path | None:
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "ucx_perftest"
    return binary if binary.is_file() else None


def perftest_cuda(binary: Path) -> float:
    """GB/s of `ucx_perftest tag_bw -m cuda` (server and client processes, one GPU)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(binary.parent.parent / "lib"),
        "UCX_WARN_UNUSED_ENV_VARS": "n",
    }
    args = ["-t", "tag_bw", "-m", "cuda", "-s", str(PERFTEST_BYTES), "-n", "200", "-p", port]
    server = subprocess.Popen(
        [str(binary), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(1.0)
        out = subprocess.run(
            [str(binary), "127.0.0.1", *args], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        server.kill()
        server.wait()
    final = [line for line in out.stdout.splitlines() if line.startswith("Final:")]
    if not final:
        raise RuntimeError(f"ucx_perftest gave no result: {out.stdout[-500:]}{out.stderr[-500:]}")
    return float(final[-1].split()[6]) * 2**20 / 1e9  # bandwidth overall, MB/s (2^20 B)


# ---- decode tokens/s ------------------------------------------------------------------------
def sync() -> None:
    import torch

    if DEVICE["name"] == "cuda":
        torch.cuda.synchronize()


def engine_decode_rate(path: Path, batch: int, graphs: bool) -> float:

    from shared.engine.config import EngineConfig
    from shared.engine.core import EngineCore
    from shared.engine.roles.decode_role import DecodeSettings
    from shared.engine.sampling.sampling_params import SamplingParams

    config = EngineConfig(
        model=str(path),
        num_kv_blocks=2048,
        max_batch_size=128,
        max_num_tokens=8192,
        device=DEVICE["name"],
        dtype=DEVICE["dtype"],
        cuda_graphs=graphs,
    )
    core = EngineCore(config, role=DecodeSettings())
    rng = random.Random(batch)
    rate = 0.0
    for _ in range(2):  # the first round captures the graphs, the second is timed
        for _ in range(batch):
            prompt = prompt_ids(rng, DECODE["prompt"], "smollm2-135m")
            core.add_request(prompt, SamplingParams(max_tokens=DECODE["tokens"], ignore_eos=True))
        first = 0
        while first < batch:
            first += len(core.step())
        sync()
        t0, tokens = time.perf_counter(), 0
        while core.has_work:
            tokens += sum(len(d.token_ids) for d in core.step())
        sync()
        rate = tokens / (time.perf_counter() - t0)
    assert core.shutdown()
    return rate


def hf_decode_rate(model: Any, batch: int) -> float:
    import torch

    rng = random.Random(batch)
    ids = torch.tensor([prompt_ids(rng, DECODE["prompt"], "smollm2-135m") for _ in range(batch)])
    ids = ids.to(DEVICE["name"])
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
        sync()
        t0 = time.perf_counter()
        model.generate(
            ids, max_new_tokens=DECODE["tokens"], min_new_tokens=DECODE["tokens"], **kwargs
        )
        sync()
    return batch * DECODE["tokens"] / (time.perf_counter() - t0)


def decode_section(path: Path, budget: Budget) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, DEVICE["dtype"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE["name"]).eval()
    rates: dict[str, dict[str, float]] = {}
    for b in DECODE_BATCHES:
        if budget.left() < 25:
            break
        rates[str(b)] = {
            "graphs": engine_decode_rate(path, b, True),
            "eager": engine_decode_rate(path, b, False),
            "transformers": hf_decode_rate(hf, b),
        }
    return {
        "prompt_tokens": DECODE["prompt"],
        "new_tokens": DECODE["tokens"],
        "tokens_per_s": rates,
    }


def decode_summary(result: dict[str, Any]) -> list[list[str]]:
    out = []
    for b, r in result["tokens_per_s"].items():
        target, ok = "", ""
        if b == "1":
            x = r["graphs"] / r["eager"]
            target, ok = f"graphs >= 2x eager: {x:.2f}x", "ok" if x >= 2 else "FAIL"
        if b == "32":
            x = r["graphs"] / r["transformers"]
            target, ok = f"graphs >= 5x generate: {x:.2f}x", "ok" if x >= 5 else "FAIL"
        out.append(
            [
                f"decode tok/s smollm2 B={b}: graphs / eager / transformers",
                f"{r['graphs']:.0f} / {r['eager']:.0f} / {r['transformers']:.0f}",
                target,
                ok,
            ]
        )
    return out


# ---- driver ---------------------------------------------------------------------------------
def dry_run() -> int:
    for name in MODELS:
        shapes = param_shapes(name)
        params = sum(int(__import__("math").prod(s)) for s in shapes.values())
        longest = max(PROMPT_LENGTHS) + 2
        assert longest <= MODELS[name]["max_position_embeddings"], f"{name}: prompts too long"
        print(f"plan {name}: {params / 1e6:.0f}M params, {kv_bytes_per_token(name)} KV B/token")
    binary = perftest_binary()
    print(
        f"bench plan ok: {len(MODELS)} models, lengths {PROMPT_LENGTHS}, "
        f"batches {DECODE_BATCHES}, ucx_perftest {'found' if binary else 'not installed'}"
    )
    return 0


def section(result: dict[str, Any], key: str, fn: Any, out: Path) -> Any:
    try:
        result[key] = fn()
    except Exception as e:  # one failing section must not hide the others' numbers
        result[key] = {"error": f"{type(e).__name__}: {e}"}
        result["summary"].append([key, f"error: {type(e).__name__}: {str(e)[:80]}", "", "FAIL"])
    (out / "gpu_bench.json").write_text(json.dumps(result, indent=1, default=str))
    return result[key]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    p.add_argument("--budget", type=float, default=170.0, help="seconds for the whole run")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: test the plumbing")
    return p.parse_args(argv)


def shrink_for_smoke() -> None:
    use_smoke()
    PROMPT_LENGTHS[:] = [32, 64]
    REPS[0] = 1
    DECODE_BATCHES[:] = [1, 4]
    DECODE.update(prompt=8, tokens=8)


def bandwidth_sections(result: dict[str, Any], out: Path) -> float | None:
    """The copy and UCX ceilings (CUDA only); returns ucx_perftest's GB/s, if it ran."""
    perf = None
    if DEVICE["name"] == "cuda":
        copy = section(result, "copy_gbs", copy_bandwidth, out)
        if isinstance(copy, float):
            row = ["D2D copy (torch, 1 GiB), GB/s", f"{copy:.0f}", "ceiling", ""]
            result["summary"].append(row)
        binary = perftest_binary()
        perf = section(result, "perftest_gbs", lambda: binary and perftest_cuda(binary), out)
        perf = perf if isinstance(perf, float) else None
    result["summary"].append(
        [
            "ucx_perftest -m cuda 64 MiB, GB/s",
            f"{perf:.1f}" if perf else "not run",
            "KV push reference",
            "",
        ]
    )
    return perf


def model_sections(result: dict[str, Any], budget: Budget, out: Path, perf: float | None) -> None:
    """Write each model's checkpoint, then decode throughput and P/D runs within the budget."""
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        paths = {
            n: section(result, f"checkpoint_{n}", lambda n=n: write_checkpoint(n, Path(tmp)), out)
            for n in MODELS
        }
        result.update({f"checkpoint_{n}": str(v) for n, v in paths.items()})
        if isinstance(paths["smollm2-135m"], Path):
            dec = section(
                result, "decode", lambda: decode_section(paths["smollm2-135m"], budget), out
            )
            if "tokens_per_s" in dec:
                result["summary"] += decode_summary(dec)
        for n, path in paths.items():
            if not isinstance(path, Path) or budget.left() < 40:
                result["summary"].append([f"P/D {n}", "skipped: time budget", "", ""])
                continue
            pd = section(result, f"pd_{n}", lambda n=n, path=path: pd_section(n, path, budget), out)
            if "requests" in pd:
                result["summary"] += pd_summary(pd, perf)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.dry_run:
        return dry_run()
    import torch

    if a.smoke:
        shrink_for_smoke()
    budget = Budget(a.budget)
    a.out.mkdir(parents=True, exist_ok=True)
    cuda = DEVICE["name"] == "cuda"
    result: dict[str, Any] = {
        "summary": [],
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke)",
    }
    perf = bandwidth_sections(result, a.out)
    if cuda:
        fam = section(result, "families", families_section, a.out)
        if "error" not in fam:
            result["summary"] += families_summary(fam)
    model_sections(result, budget, a.out, perf)
    (a.out / "gpu_bench.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
