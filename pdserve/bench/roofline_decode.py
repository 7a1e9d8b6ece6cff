"""The roofline benchmark's decode measurement: step time at each batch size against the read
bandwidth measured beside it, and, where the one-call decode stack covers the step
(shared/model/decode_stack.py), the layer loop it replaces in the same rounds.

These VMs' memory bandwidth moves by +-15% within minutes (docs/performance.md, "Method"), so a
bandwidth measured once at the start and a handful of steps minutes later gave ratios 0.45-0.64x
for one code. Each batch size therefore runs `ROUNDS` rounds, each a `sum()` bandwidth read right
before its steps; the ratio is the median step against the median of those reads.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from pdserve.bench.roofline_ceilings import bandwidth
from shared.engine.core import EngineCore
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model import decode_stack

DECODE_CONTEXT = 128  # prompt tokens of each decode request
DECODE_STEPS = 16  # steps per round and mode (the last one, which frees, not counted)
ROUNDS = 3


def prompt(rng: random.Random, tokens: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(tokens)]


def decode_setup(core: EngineCore, batch: int, steps: int) -> None:
    """`batch` requests prefilled and one token in: every later step is a pure decode step."""
    rng, vocab = random.Random(batch), core.model_config.vocab_size
    for _ in range(batch):
        params = SamplingParams(max_tokens=1 + steps, ignore_eos=True)
        core.add_request(prompt(rng, DECODE_CONTEXT, vocab), params)
    while any(not r.output_token_ids for r in core.requests.values()):
        core.step()


def decode_step_seconds(core: EngineCore, batch: int, steps: int) -> list[float]:
    decode_setup(core, batch, steps)
    times = []
    while core.has_work:
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    core.check_conservation()
    return times[:-1] or times  # the last step also finishes (and frees) every request


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def measure_batch(
    core: EngineCore, dtype: torch.dtype, batch: int, read_bytes: int, reps: int
) -> dict[str, Any]:
    """Median step seconds (and, where the stack covers it, the layer loop's) over the rounds,
    and the median read bandwidth measured before each round."""
    steps: dict[str, list[float]] = {"step": [], "layer_loop": []}
    reads = []
    for _ in range(ROUNDS):
        reads.append(bandwidth(read_bytes, reps)["read_gbps"])
        steps["step"] += decode_step_seconds(core, batch, DECODE_STEPS)
        if decode_stack.covers(dtype, batch):
            with decode_stack.layer_loop():
                steps["layer_loop"] += decode_step_seconds(core, batch, DECODE_STEPS)
    result = {"step_s": median(steps["step"]), "read_gbps": median(reads), "reads": reads}
    if steps["layer_loop"]:
        result["layer_loop_step_s"] = median(steps["layer_loop"])
    return result
