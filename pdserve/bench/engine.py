"""Output tokens/s of the colocated engine vs transformers `generate` on the same weights.

64 requests with mixed prompt (16-512) and output (8-128) lengths, batch limits 1, 8, 32. The
baseline is what a static batch does: transformers runs each group of B requests (in arrival
order) until its longest member is done; pdserve's continuous batching refills a seat as soon as
a request ends. Both are measured in the same run; the headline is their ratio.

    python -m pdserve.bench.engine [--quick] [--out bench_out]

`--moe` measures a mixture-of-experts model instead (pdserve/bench/engine_moe.py: batched
experts vs a per-token loop); the other flags then are that module's. `--mla` likewise measures
latent attention (pdserve/bench/engine_mla.py: KV bytes per token against full K/V, decode in
latent space vs expanded).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from pdserve.bench.support.util import bar_plot, environment, write_json
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model

MODEL = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
}


def build_model_dir(root: Path) -> Path:
    from pdserve.bench.support.checkpoints import build_checkpoint

    return build_checkpoint("llama", root / "bench-llama", seed=0, **MODEL)


def workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int = 0):
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, MODEL["vocab_size"]) for _ in range(rng.randint(*prompt_range))]
        for _ in range(n)
    ]
    outputs = [rng.randint(*output_range) for _ in range(n)]
    return prompts, outputs


def run_pdserve(path: Path, prompts: list[list[int]], outputs: list[int], batch: int) -> float:
    # fp32 like the transformers baseline (`--dtype auto` is bf16 on AMX CPUs)
    engine = LLM(
        EngineConfig(
            model=str(path),
            num_kv_blocks=4096,
            max_batch_size=batch,
            max_num_tokens=1024,
            dtype="float32",
        ),
        load_model(str(path), dtype=torch.float32),
    )
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in outputs]
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(r.token_ids) for r in results] == outputs
    engine.check_conservation()
    return sum(outputs) / elapsed


def run_transformers(path: Path, prompts: list[list[int]], outputs: list[int], batch: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group, lens = prompts[i : i + batch], outputs[i : i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                pad_token_id=pad,
            )
    elapsed = time.perf_counter() - start
    return sum(outputs) / elapsed


def _variant(args: list[str]) -> dict[str, object] | None:
    """`--moe` / `--mla`: that module's benchmark on the other flags; else None."""
    if "--moe" in args:
        from pdserve.bench import engine_moe

        return engine_moe.main([x for x in args if x != "--moe"])
    if "--mla" in args:
        from pdserve.bench import engine_mla

        return engine_mla.main([x for x in args if x != "--mla"])
    return None


def main(argv: list[str] | None = None) -> dict[str, object]:
    variant = _variant(sys.argv[1:] if argv is None else list(argv))
    if variant is not None:
        return variant
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny workload (CI smoke test)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument(
        "--moe", action="store_true", help="a mixture-of-experts model (batched vs per-token)"
    )
    parser.add_argument(
        "--mla", action="store_true", help="latent attention: KV bytes per token, decode paths"
    )
    a = parser.parse_args(argv)
    n, prange, orange = (8, (16, 64), (4, 16)) if a.quick else (64, (16, 512), (8, 128))
    batches = [int(b) for b in a.batches.split(",")]
    prompts, outputs = workload(n, prange, orange)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model_dir(Path(tmp))
        for batch in tqdm(batches, desc="batch limits", unit="cfg"):
            ours = run_pdserve(path, prompts, outputs, batch)
            theirs = run_transformers(path, prompts, outputs, batch)
            rows.append(
                {
                    "max_batch_size": batch,
                    "pdserve_tokens_per_s": ours,
                    "transformers_tokens_per_s": theirs,
                    "ratio": ours / theirs,
                }
            )
            tqdm.write(
                f"batch {batch:>3}: pdserve {ours:8.1f} tok/s  transformers {theirs:8.1f} tok/s"
                f"  ratio {ours / theirs:.2f}x"
            )
    result = {
        "benchmark": "engine_throughput",
        "requests": n,
        "prompt_len_range": prange,
        "output_len_range": orange,
        "model": MODEL,
        "environment": environment(),
        "rows": rows,
    }
    write_json(a.out / "engine_throughput.json", result)
    bar_plot(
        a.out / "engine_throughput.png",
        "Output tokens/s: continuous batching vs static-batch generate",
        [f"batch {r['max_batch_size']}" for r in rows],
        {
            "pdserve": [r["pdserve_tokens_per_s"] for r in rows],
            "transformers": [r["transformers_tokens_per_s"] for r in rows],
        },
        "output tokens / s",
    )
    return result


if __name__ == "__main__":
    main()
