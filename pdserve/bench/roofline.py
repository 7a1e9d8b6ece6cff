"""How close the engine runs to this machine's ceilings, per model and dtype, in one run.

(a) Ceilings: bare `F.linear` GFLOP/s of the model's own GEMM shapes at the token counts prefill
    uses, and memory read bandwidth (sum of a tensor larger than the last-level cache).
(b) Engine (`EngineCore`, one request of T prompt tokens and one output token; B requests in
    decode): prefill tokens/s at 128..4k tokens, decode step time at batch 1..128, 1 and 2 threads.
(c) Ratios: prefill's effective FLOP rate (2 x linear-layer params x tokens / time) over the
    matmul ceiling at the same token count and threads, and the same with the causal attention's
    FLOPs added (`with_attention_ratio`), with each part's share of the prefill's time
    (attention, the GEMMs, the rest: `time_share`, from torch's profiler); decode's weight-read
    bandwidth (weight bytes per step / step time) over the measured read bandwidth. Plus a
    torch-profiler per-op table of one prefill and one decode step, and bf16-vs-fp32 greedy
    agreement.

    python -m pdserve.bench.roofline [--quick] [--out bench_out] [--models tiny,smollm2,large]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pdserve.bench.dtype_agreement import agreement, greedy_tokens
from pdserve.bench.roofline_ceilings import bandwidth, matmul_ceiling
from pdserve.bench.roofline_decode import (
    DECODE_CONTEXT,
    DECODE_STEPS,
    decode_setup,
    measure_batch,
    prompt,
)
from pdserve.bench.roofline_models import (
    DTYPES,
    attention_flops,
    linear_params,
    load_bench_model,
    weight_bytes_per_step,
)
from pdserve.bench.roofline_report import roofline_plot, step_profile, top_ops
from pdserve.bench.support.util import environment, write_json
from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model import attention_timing
from shared.model.attention_choice import Choice
from shared.model.loader import LoadedModel

PREFILL_TARGET, DECODE_TARGET, PREFILL_TARGET_MIN_TOKENS = 0.7, 0.7, 512


def _core(loaded: LoadedModel, dtype: str, batch: int, budget: int, blocks: int) -> EngineCore:
    config = EngineConfig(
        model=loaded.name,
        num_kv_blocks=blocks,
        max_batch_size=batch,
        max_num_tokens=budget,
        enable_prefix_caching=False,  # a repeated prompt must be computed again
        device="cpu",
        dtype=dtype,
    )
    return EngineCore(config, loaded, role=DecodeSettings())


def _drain(core: EngineCore) -> None:
    while core.has_work:
        core.step()


def prefill_seconds(core: EngineCore, tokens: int, reps: int) -> list[float]:
    """Wall time of prompt -> first token for one request, after one warm-up."""
    rng, vocab = random.Random(tokens), core.model_config.vocab_size
    times = []
    for i in range(reps + 1):
        core.add_request(prompt(rng, tokens, vocab), SamplingParams(max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        _drain(core)
        if i:
            times.append(time.perf_counter() - start)
    core.check_conservation()
    return times


def measure_run(model: str, dtype: str, a: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    loaded, source = load_bench_model(model, DTYPES[dtype])
    c, name = loaded.config, {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    lengths = [t for t in a.lengths if t < c.max_context_len]
    params, weights = linear_params(c), weight_bytes_per_step(loaded)
    run: dict[str, Any] = {
        "model": model,
        "dtype": dtype,
        "weights": source,
        "config": {k: getattr(c, k) for k in ("hidden_size", "intermediate_size", "num_layers")},
        "linear_params": params,
        "weight_bytes_per_decode_step": weights,
        "matmul_ceiling": [],
        "prefill": [],
        "decode": [],
    }
    blocks = max(max(lengths), max(a.batches) * (DECODE_CONTEXT + DECODE_STEPS + 16)) // 16 + 64
    torch.set_num_threads(a.threads[0])
    # the attention paths a node would take here: timed (or cached, or forced) as at its start
    choice = attention_timing.establish(c, DTYPES[dtype], "cpu")
    run["attention"] = choice.as_dict() if choice is not None else None
    for threads in a.threads:
        torch.set_num_threads(threads)
        _measure_prefill(run, loaded, dtype, threads, lengths, blocks, a, bar)
        _measure_decode(run, loaded, dtype, threads, blocks, a, bar)
    torch.set_num_threads(a.threads[0])
    run["profile"] = profile_steps(loaded, name, max(lengths), 8, blocks)
    if a.agreement_tokens:
        run["greedy"] = greedy_tokens(loaded, name, a.agreement_prompts, a.agreement_tokens)
    del loaded
    gc.collect()
    return run


def _measure_prefill(
    run: dict[str, Any],
    loaded: LoadedModel,
    dtype: str,
    threads: int,
    lengths: list[int],
    blocks: int,
    a: argparse.Namespace,
    bar: tqdm,
) -> None:
    """Prefill tokens/s at each length against the bare-matmul ceiling of the same shapes."""
    c, model, name = loaded.config, run["model"], {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    params = run["linear_params"]
    elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
    prefill = _core(loaded, name, 1, max(lengths), blocks)
    for tokens in lengths:
        bar.set_postfix_str(f"{model} {dtype} {threads}t prefill {tokens}")
        ceiling = matmul_ceiling(c, DTYPES[dtype], tokens, a.reps)
        run["matmul_ceiling"].append({"threads": threads, **ceiling})
        seconds = min(prefill_seconds(prefill, tokens, a.prefill_reps))
        linear, attention = 2.0 * params * tokens, attention_flops(c, tokens)
        gflops, all_gflops = linear / seconds / 1e9, (linear + attention) / seconds / 1e9
        run["prefill"].append(
            {
                "tokens": tokens,
                "threads": threads,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "linear_gflop": linear / 1e9,
                "attention_gflop": attention / 1e9,
                "effective_gflops": gflops,
                "ceiling_gflops": ceiling["gflops"],
                "ratio": gflops / ceiling["gflops"],
                # the measure: linear + causal attention FLOPs over the matmul ceiling
                "with_attention_gflops": all_gflops,
                "with_attention_ratio": all_gflops / ceiling["gflops"],
                "intensity": 2.0 * tokens / elem,
                "time_share": prefill_time_shares(prefill, tokens),
            }
        )
        bar.update()
    del prefill


def prefill_time_shares(core: EngineCore, tokens: int) -> dict[str, float]:
    """Share of one prefill step's CPU time in attention, the GEMMs and the rest (profiled)."""
    core.add_request(
        prompt(random.Random(tokens), tokens, core.model_config.vocab_size),
        SamplingParams(max_tokens=1, ignore_eos=True),
    )
    shares = step_profile(core.step, limit=0)["time_share"]
    _drain(core)
    return shares


def _measure_decode(
    run: dict[str, Any],
    loaded: LoadedModel,
    dtype: str,
    threads: int,
    blocks: int,
    a: argparse.Namespace,
    bar: tqdm,
) -> None:
    """Decode step time at each batch against the measured read bandwidth."""
    c, model, name = loaded.config, run["model"], {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    weights = run["weight_bytes_per_decode_step"]
    elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
    kv_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * elem
    decode = _core(loaded, name, max(a.batches), 4096, blocks)
    for batch in a.batches:
        bar.set_postfix_str(f"{model} {dtype} {threads}t decode {batch}")
        m = measure_batch(decode, DTYPES[dtype], batch, a.bandwidth_mib * 2**20, a.reps)
        step, read = m["step_s"], m["read_gbps"]
        kv_bytes = batch * (DECODE_CONTEXT + DECODE_STEPS // 2) * kv_per_token
        point = {
            "batch": batch,
            "threads": threads,
            "step_ms": step * 1e3,
            "output_tokens_per_s": batch / step,
            "weight_gbps": weights / step / 1e9,
            "weight_and_kv_gbps": (weights + kv_bytes) / step / 1e9,
            "read_gbps": read,
            "read_gbps_per_round": m["reads"],
            "bandwidth_ratio": weights / step / 1e9 / read,
            "effective_gflops": 2.0 * weights / elem * batch / step / 1e9,
            "intensity": 2.0 * batch / elem,
        }
        if "layer_loop_step_s" in m:  # the same steps without the one-call decode stack
            loop = m["layer_loop_step_s"]
            point["layer_loop_step_ms"] = loop * 1e3
            point["layer_loop_bandwidth_ratio"] = weights / loop / 1e9 / read
        run["decode"].append(point)
        bar.update()
    del decode


def profile_steps(
    loaded: LoadedModel, dtype: str, tokens: int, batch: int, blocks: int
) -> dict[str, Any]:
    """Per-op self-CPU time of one prefill step (`tokens`) and one decode step (`batch`)."""
    core = _core(loaded, dtype, batch, max(tokens, batch * DECODE_CONTEXT), blocks)
    prefill_seconds(core, tokens, 0)  # warm-up
    core.add_request(
        prompt(random.Random(0), tokens, loaded.config.vocab_size),
        SamplingParams(max_tokens=1, ignore_eos=True),
    )
    prefill = step_profile(core.step)
    _drain(core)
    decode_setup(core, batch, 2)
    decode_ops = top_ops(core.step)
    _drain(core)
    core.check_conservation()
    return {
        "prefill": {"tokens": tokens, **prefill},
        "decode": {"batch": batch, "context": DECODE_CONTEXT, "top_ops": decode_ops},
    }


def targets(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each target per model and dtype: the worst ratio it covers, and whether it is met."""
    out: dict[str, Any] = {}
    for run in runs:
        key = f"{run['model']}/{run['dtype']}"
        pre = [p["ratio"] for p in run["prefill"] if p["tokens"] >= PREFILL_TARGET_MIN_TOKENS]
        dec = [d["bandwidth_ratio"] for d in run["decode"] if d["batch"] == 1]
        out[key] = {
            "prefill_ge_0_7x_matmul_ge_512_tokens": {
                "worst_ratio": min(pre) if pre else None,
                "met": bool(pre) and min(pre) >= PREFILL_TARGET,
            },
            "decode_b1_ge_0_7x_bandwidth": {
                "worst_ratio": min(dec) if dec else None,
                "met": bool(dec) and min(dec) >= DECODE_TARGET,
            },
        }
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few points (CI)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument("--models", default="tiny,smollm2,large")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--lengths", type=_ints, default=[128, 512, 1024, 2048, 4096])
    parser.add_argument("--batches", type=_ints, default=[1, 8, 32, 128])
    parser.add_argument("--threads", type=_ints, default=[1, 2])
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each bare op")
    parser.add_argument("--prefill-reps", type=int, default=2)
    parser.add_argument("--bandwidth-mib", type=int, default=2048)
    parser.add_argument("--agreement-prompts", type=int, default=8)
    parser.add_argument("--agreement-tokens", type=int, default=64)
    a = parser.parse_args(argv)
    if a.quick:
        a.models, a.lengths, a.batches, a.threads = "tiny", [128, 512], [1, 8], [1]
        a.reps, a.prefill_reps, a.bandwidth_mib = 2, 1, 256
        a.agreement_prompts, a.agreement_tokens = 2, 8
    a.models, a.dtypes = a.models.split(","), a.dtypes.split(",")
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    started, load_before = time.time(), [round(x, 2) for x in os.getloadavg()]
    bw: dict[int, dict[str, float]] = {}
    for threads in a.threads:
        torch.set_num_threads(threads)
        bw[threads] = {"threads": threads, **bandwidth(a.bandwidth_mib * 2**20, a.reps)}
        print(f"read bandwidth, {threads} thread(s): {bw[threads]['read_gbps']:.1f} GB/s")
    points = len(a.models) * len(a.dtypes) * len(a.threads) * (len(a.lengths) + len(a.batches))
    runs: list[dict[str, Any]] = []
    with tqdm(total=points, desc="roofline", unit="pt") as bar:
        for model in a.models:
            for dtype in a.dtypes:
                runs.append(measure_run(model, dtype, a, bar))
                _report(runs[-1])
                # a long run keeps what it has measured if it is stopped later
                write_json(a.out / "roofline.partial.json", {"runs": runs, "bandwidth": bw})
    result = _result(a, runs, bw, started, load_before)
    write_json(a.out / "roofline.json", result)
    (a.out / "roofline.partial.json").unlink(missing_ok=True)
    roofline_plot(a.out / "roofline.png", runs, bw[a.threads[0]]["read_gbps"])
    return result


def _result(
    a: argparse.Namespace,
    runs: list[dict[str, Any]],
    bw: dict[int, dict[str, float]],
    started: float,
    load_before: list[float],
) -> dict[str, Any]:
    greedy = {}
    for model in a.models:
        by_dtype = {r["dtype"]: r.pop("greedy", None) for r in runs if r["model"] == model}
        if by_dtype.get("fp32") and by_dtype.get("bf16"):
            greedy[model] = agreement(by_dtype["fp32"], by_dtype["bf16"])
    return {
        "benchmark": "roofline",
        "quick": a.quick,
        "environment": environment(),
        "load_average": {"start": load_before, "end": [round(x, 2) for x in os.getloadavg()]},
        "wall_s": time.time() - started,
        "bandwidth": list(bw.values()),
        "runs": runs,
        "bf16_vs_fp32_greedy": greedy,
        "targets": targets(runs),
    }


def _report(run: dict[str, Any]) -> None:
    if run.get("attention"):
        choice = Choice(**run["attention"]).describe()
        tqdm.write(f"{run['model']:>8} {run['dtype']} attention: {choice}")
    for p in run["prefill"]:
        tqdm.write(
            f"{run['model']:>8} {run['dtype']} {p['threads']}t prefill {p['tokens']:>5}: "
            f"{p['tokens_per_s']:8.0f} tok/s  {p['effective_gflops']:7.1f} GFLOP/s  "
            f"= {p['ratio']:.2f}x matmul ceiling; with attention "
            f"{p['with_attention_gflops']:7.1f} GFLOP/s = {p['with_attention_ratio']:.2f}x; "
            f"time: attention {p['time_share']['attention']:.0%}, "
            f"linear {p['time_share']['linear']:.0%}, other {p['time_share']['other']:.0%}"
        )
    for d in run["decode"]:
        tqdm.write(
            f"{run['model']:>8} {run['dtype']} {d['threads']}t decode b{d['batch']:<4}: "
            f"{d['step_ms']:7.1f} ms/step  {d['output_tokens_per_s']:8.0f} tok/s  "
            f"weights {d['weight_gbps']:.1f} GB/s = {d['bandwidth_ratio']:.2f}x bandwidth "
            f"({d['read_gbps']:.1f} GB/s)"
            + (
                f"; layer loop {d['layer_loop_step_ms']:.1f} ms = "
                f"{d['layer_loop_bandwidth_ratio']:.2f}x"
                if "layer_loop_step_ms" in d
                else ""
            )
        )


if __name__ == "__main__":
    main()
