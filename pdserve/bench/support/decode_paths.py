"""Decode tokens/s of one in-process engine along two interchangeable paths (the engine
benchmarks' --moe and --mla): a dummy-weight model, runs that alternate between the paths, the
best of each, and the check that both paths gave the same greedy tokens."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.bench.support.util import environment, load_average, write_json
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.config import ModelConfig
from shared.model.loader import LoadedModel
from shared.model.registry import build_model
from shared.model.tokenizer import ByteTokenizer


@dataclass(frozen=True)
class DecodePaths:
    """`names`: the JSON's names of the two paths, the engine's own first (each batch ends on
    it); `labels`: the report line's; `use(name)` switches the engine onto a path."""

    names: tuple[str, str]
    labels: tuple[str, str]
    use: Callable[[str], None]


def parse_args(
    argv: list[str] | None,
    description: str,
    *,
    batches: str,
    reps: int,
    context: int | None = None,
) -> argparse.Namespace:
    """The comparison's flags, --batches read into a list; `context`: --context's default, for a
    benchmark that lets the prompt length be chosen."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="toy shapes (CI smoke test)")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--batches", default=batches)
    p.add_argument("--layers", type=int, default=1)
    if context is not None:
        p.add_argument("--context", type=int, default=context, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=8, help="decode steps per measurement")
    p.add_argument("--reps", type=int, default=reps, help="runs per path; the best counts")
    a = p.parse_args(argv)
    a.batches = [int(b) for b in a.batches.split(",")]
    return a


def dummy_model(config: ModelConfig, seed: int = 0) -> LoadedModel:
    """fp32 N(0, 0.02) matrices, unit norms: the router spreads tokens over the experts."""
    model = build_model(config, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    tokenizer = ByteTokenizer(vocab_size=config.vocab_size)
    return LoadedModel(model, config, tokenizer, "moe-dummy", frozenset())


def decode_rate(llm: LLM, batch: int, steps: int, prompt_len: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s at `batch` sequences of `prompt_len`-token prompts (timed from the step
    after every prompt has its first token) and the tokens generated."""
    gen = torch.Generator().manual_seed(batch)
    vocab = llm.core.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    ids = [llm.add_request(p, params).request_id for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    start, decoded = 0.0, 0
    while llm.core.has_work:
        deltas = llm.step()
        for delta in deltas:
            tokens[delta.request_id].extend(delta.token_ids)
        if start:
            decoded += sum(len(d.token_ids) for d in deltas)
        elif all(tokens.values()):
            start = time.perf_counter()  # prefill done: decode steps from here on
    return decoded / (time.perf_counter() - start), [tokens[i] for i in ids]


def compare(
    llm: LLM, paths: DecodePaths, batch: int, steps: int, reps: int, prompt_len: int
) -> dict[str, object]:
    """Best of `reps` alternating runs per path: on a shared machine the best run is the one
    least disturbed by other processes (and the first pays for the GEMMs' per-shape setup)."""
    first, second = paths.names
    rates: dict[str, list[float]] = {first: [], second: []}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(reps):
        for path, runs in rates.items():
            paths.use(path)
            rate, tokens[path] = decode_rate(llm, batch, steps, prompt_len)
            runs.append(rate)
    paths.use(first)
    if tokens[first] != tokens[second]:
        raise AssertionError(f"batch {batch}: the {first} and {second} paths' tokens differ")
    best = {path: max(runs) for path, runs in rates.items()}
    return {
        "batch": batch,
        f"{first}_tokens_per_s": best[first],
        f"{second}_tokens_per_s": best[second],
        "ratio": best[first] / best[second],
        "runs": rates,
    }


def compare_batches(
    llm: LLM,
    paths: DecodePaths,
    batches: Sequence[int],
    steps: int,
    reps: int,
    prompt_len: int,
    where: str = "",
) -> list[dict[str, object]]:
    """`compare` at each batch size, a line each on stdout (`where`: what follows the batch)."""
    rows = []
    for batch in batches:
        row = compare(llm, paths, batch, steps, reps, prompt_len)
        rows.append(row)
        (first, second), (label_1, label_2) = paths.names, paths.labels
        print(
            f"batch {batch:>3}{where}: {label_1} {row[f'{first}_tokens_per_s']:8.1f} tok/s  "
            f"{label_2} {row[f'{second}_tokens_per_s']:8.1f} tok/s  ratio {row['ratio']:.2f}x"
        )
    return rows


def write_result(
    llm: LLM, path: Path, head: dict[str, object], rows: list[dict[str, object]]
) -> dict[str, object]:
    """`head`, the machine's state and `rows`, written to `path` once every seat and block is
    back in its pool (the runs leaked none)."""
    llm.check_conservation()
    result = {**head, "load_average": load_average(), "environment": environment(), "rows": rows}
    write_json(path, result)
    return result
