"""Many LoRA adapters in one batch against the base model alone, same model, same run.

    pdserve bench lora [--hidden 2048] [--layers 4] [--batch 32] [--adapters 8] [--rank 16]
                       [--reps 15] [--quick] [--out bench_out]

A random Llama checkpoint and `--adapters` random PEFT adapters (rank `--rank` on all seven
projections) are written under --out; one decode step of `--batch` sequences (context 64) runs
through the model with every sequence on the base model, then with the sequences spread evenly
over the adapters, alternating so drift on a noisy machine falls on both. Reports the best and
median step times and the throughput ratio (base step / mixed step), as JSON in --out.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from pdserve.bench.support.checkpoints import cached_checkpoint, load_hf_model
from pdserve.bench.support.lora_adapters import ALL_PROJECTIONS, AdapterSpec, write_adapter
from pdserve.bench.support.util import environment, load_average, write_json
from shared.kv.pool import allocate_kv_pool
from shared.model.forward_batch import ForwardBatch, SeqEntry
from shared.model.loader import LoadedModel, load_model
from shared.model.lora_batch import lora_batch
from shared.model.lora_install import install_lora

CONTEXT, BLOCK = 64, 16


def build(a: argparse.Namespace) -> LoadedModel:
    root = Path(a.out) / "lora"
    shape = {"hidden_size": a.hidden, "intermediate_size": a.hidden * 11 // 4}
    shape |= {"num_attention_heads": a.hidden // 128, "num_key_value_heads": a.hidden // 256}
    base = cached_checkpoint(root, "llama", num_hidden_layers=a.layers, **shape)
    hf = load_hf_model(base)
    paths = {}
    for i in range(a.adapters):
        path = root / f"{base.name}-r{a.rank}-{i}"
        if not path.is_dir():
            write_adapter(hf, path, AdapterSpec(a.rank, 2.0 * a.rank, ALL_PROJECTIONS, seed=i))
        paths[f"a{i}"] = str(path)
    loaded = load_model(str(base), dtype=torch.float32)
    install_lora(loaded.model, paths, a.adapters, a.rank)
    return loaded


def step_times(loaded: LoadedModel, a: argparse.Namespace) -> dict[str, list[float]]:
    blocks = CONTEXT // BLOCK + 1
    layout = loaded.config.kv_layout(BLOCK, torch.float32)
    pool = allocate_kv_pool(layout, a.batch * blocks, loaded.model.device)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(a.batch)]
    plain = ForwardBatch.build([SeqEntry([5], CONTEXT, t) for t in tables], BLOCK, "cpu")
    slots = [i % a.adapters for i in range(a.batch)]
    mixed = replace(plain, lora=lora_batch(slots, plain.query_lens, torch.device("cpu")))
    times: dict[str, list[float]] = {"base": [], "mixed": []}
    for rep in range(a.reps + 2):  # the first two warm up
        for name, batch in (("base", plain), ("mixed", mixed)):
            start = time.perf_counter()
            loaded.model(batch, pool)
            if rep >= 2:
                times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench lora", description=__doc__)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--quick", action="store_true", help="a 256-hidden 2-layer model, 3 reps")
    a = p.parse_args(argv)
    if a.quick:
        a.hidden, a.layers, a.reps = 256, 2, 3
    times = step_times(build(a), a)
    summary = {
        name: {"best_ms": min(t) * 1e3, "median_ms": statistics.median(t) * 1e3}
        for name, t in times.items()
    }
    ratio = min(times["base"]) / min(times["mixed"])
    print(
        f"decode step, batch {a.batch}, hidden {a.hidden} x {a.layers} layers, fp32: base "
        f"{summary['base']['best_ms']:.1f} ms, {a.adapters} adapters (rank {a.rank}) mixed "
        f"{summary['mixed']['best_ms']:.1f} ms (best of {a.reps}); throughput {ratio:.2f}x base"
    )
    payload = {"args": vars(a), "steps": summary, "ratio": ratio, "load": load_average()}
    write_json(Path(a.out) / "lora.json", payload | {"environment": environment()})
    return 0
