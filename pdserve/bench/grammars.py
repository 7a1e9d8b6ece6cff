"""The grammar libraries side by side: each installed one (llguidance, xgrammar) compiles the same
JSON schemas cold for the model's vocabulary, then 32 requests walk their grammars together,
timing each step's 32 next-token masks and applying them to the logits (random, so the walk
covers many states).

    pdserve bench grammars [--quick] [--model smollm2] [--steps 64] [--out bench_out]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.structured import long_schema
from pdserve.bench.support.util import environment, load_average, write_json
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.grammar_compiler import GrammarCompiler
from shared.engine.sampling.grammar_kinds import BACKEND_ENV, GrammarError
from shared.engine.sampling.grammar_rows import GrammarRows
from shared.engine.sampling.structured_output import StructuredOutput

BATCH = 32


def schemas(count: int) -> list[StructuredOutput]:
    """`count` distinct schemas: the structured benchmark's records, each with its own enum."""
    return [StructuredOutput("json_schema", json.dumps(long_schema(f"t{i}"))) for i in range(count)]


def measure(llm: LLM, backend: str, specs: list[StructuredOutput], steps: int) -> dict[str, Any]:
    os.environ[BACKEND_ENV] = backend
    tokenizer, vocab = llm.core.info.tokenizer, llm.core.info.vocab_size
    compiler = GrammarCompiler(tokenizer, vocab)
    compile_ms = []
    for s in specs:
        start = time.perf_counter()
        compiler.get(s)
        compile_ms.append((time.perf_counter() - start) * 1e3)
    seats = [specs[i % len(specs)] for i in range(BATCH)]
    matchers = [compiler.matcher(s) for s in seats]
    rows = GrammarRows(BATCH, tokenizer)
    rows.bitmask = torch.full((BATCH, (vocab + 31) // 32), -1, dtype=torch.int32)
    fill_ms, apply_ms = [], []
    for _ in range(steps):
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(rows.bitmask, i)
        fill_ms.append((time.perf_counter() - start) * 1e3)
        rows.matchers = list(matchers)
        logits = torch.randn(BATCH, vocab)
        start = time.perf_counter()
        logits = rows.apply(list(range(BATCH)), list(range(BATCH)), logits, logits.clone())
        apply_ms.append((time.perf_counter() - start) * 1e3)
        for i, token in enumerate(logits.argmax(-1).tolist()):
            if matchers[i].is_terminated() or not matchers[i].accept_token(token):
                matchers[i] = compiler.matcher(seats[i])
    return {
        "compile_ms": {"median": statistics.median(compile_ms), "max": max(compile_ms)},
        "mask_fill_ms_batch32": {"median": statistics.median(fill_ms), "max": max(fill_ms)},
        "mask_apply_ms_batch32": {"median": statistics.median(apply_ms)},
        "grammar_bytes": compiler.cache.held_bytes // len(specs),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
    parser.add_argument("--model", default=None, help="default: smollm2 (--quick: tiny)")
    parser.add_argument("--schemas", type=int, default=None, help="default 16 (--quick: 2)")
    parser.add_argument("--steps", type=int, default=None, help="default 64 (--quick: 4)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    a = parser.parse_args(argv)
    model = a.model or ("tiny" if a.quick else "smollm2")
    llm = LLM(EngineConfig(model=model, num_kv_blocks=64, max_batch_size=BATCH))
    specs = schemas(a.schemas or (2 if a.quick else 16))
    steps = a.steps or (4 if a.quick else 64)
    before = os.environ.get(BACKEND_ENV)
    load_start = load_average()
    results: dict[str, Any] = {}
    try:
        for backend in ("llguidance", "xgrammar"):
            try:
                results[backend] = measure(llm, backend, specs, steps)
            except GrammarError as e:  # xgrammar is the `structured` extra
                results[backend] = {"skipped": str(e)}
    finally:
        if before is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = before
    result = {
        "benchmark": "grammars",
        "model": model,
        "batch": BATCH,
        "schemas": len(specs),
        "steps": steps,
        "backends": results,
        "load_average": [load_start, load_average()],
        "environment": environment(),
    }
    write_json(a.out / "grammars.json", result)
    print(json.dumps(results, indent=1))
    return result
