"""The engine's malloc thresholds: set once per process unless the operator chose their own, and
what they are for: a step's large buffers reused instead of faulted in again every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from shared.engine.runtime import malloc_policy

GLIBC = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None


@pytest.mark.parametrize(
    ("environ", "reason"),
    [
        ({}, None),
        ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=2048"}, None),
        ({"PDSERVE_MALLOC_POLICY": "0"}, "PDSERVE_MALLOC_POLICY=0"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "GLIBC_TUNABLES"),
        ({"MALLOC_TRIM_THRESHOLD_": "1"}, "MALLOC_TRIM_THRESHOLD_ set"),
        ({"MALLOC_MMAP_THRESHOLD_": "1", "MALLOC_TOP_PAD_": "1"}, "MALLOC_MMAP_THRESHOLD_, "),
    ],
)
def test_operator_choice_wins(environ: dict[str, str], reason: str | None) -> None:
    got = malloc_policy.operator_choice(environ)
    assert got is None if reason is None else reason in got


# The engine's own pattern (seen with strace on `bench peer`'s bf16 batch-32 run: the heap grew
# and shrank by 1.5 GB in one generate): steps of up to 32 sequences and 1,024 tokens at
# SmolLM2's widths leave more free heap at the top than glibc's trim threshold after each
# layer's buffers go, so the next layer touches fresh pages again. The faults come from the
# prefill steps (long prompts), so 16 decode tokens a sequence show them as well as 64 did.
_ROUNDS = """
import json, random, resource, sys
from shared.engine.runtime import malloc_policy
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
llm = LLM(EngineConfig(model=sys.argv[1], dtype="float32", max_batch_size=32,
                       max_num_tokens=1024, kv_cache_memory_mb=256))
rng = random.Random(0)
faults = []
for _ in range(5):
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(16, 512))] for _ in range(32)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": malloc_policy.apply(), "faults": faults}))
"""


def _rounds(model: Path, policy: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    env["PDSERVE_MALLOC_POLICY"] = policy
    # the libraries' GEMMs (oneDNN's padded rows and scratch) made the churn; with the panel
    # kernel, which allocates nothing but its output, rounds 3-5 fault ~65 times either way
    env["PDSERVE_PANEL_GEMM"] = "0"
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, str(model)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC or not GLIBC.startswith("glibc"), reason="glibc's mallopt only")
def test_engine_steps_stop_faulting_pages_in(checkpoint: Callable[..., Path]) -> None:
    model = checkpoint(
        "llama",
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    # two processes side by side: each counts only its own faults (RUSAGE_SELF)
    with ThreadPoolExecutor(2) as pool:
        off, on = pool.map(lambda policy: _rounds(model, policy), ["0", "1"])
    assert off["applied"] is False and on["applied"] is True
    # rounds 3-5, past the first touches of the pool and of the engine's buffers: measured
    # 120k-170k faults without the policy, 7-10k with it
    steady_off, steady_on = sum(off["faults"][2:]), sum(on["faults"][2:])
    assert steady_off > 4 * steady_on, (off, on)
