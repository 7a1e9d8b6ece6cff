"""A model of the serving system for `pdserve plan`: TTFT and ITL of a node count, from a profile.

Prefill tier: simulated (pdserve/planner_sim.py): Poisson arrivals routed to the prefill node
owing the least compute, each node prefilling the prompts waiting at a step's start together in
one step (its token budget), every first token at the end of its step; TTFT = that + what the
P/D path adds to the prefill (measured: the RPC hop and the KV push), read at the target's
quantile. Decode tier: by Little's law a decode node holds B = rate/n x (output - 1) x
step(B, context) requests; the fixed point B gives the ITL, step(B), which must meet the target
within the largest measured batch. Colocated nodes: simulated step by step (chunked prefill
beside the decodes, each chunk adding its measured cost to the step it rides on), each node
taking rate/n. ITL here is the mean gap between a request's tokens (its TPOT, what `bench serve
--goodput tpot:MS` checks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pdserve import planner_sim
from pdserve.planner_profile import Profile

_FIXED_POINT_ROUNDS = 200


@dataclass(frozen=True)
class Workload:
    rate: float  # requests/s, Poisson
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Targets:
    ttft_s: float
    itl_s: float
    quantile: float = 0.9  # TTFT is met at this quantile; ITL on the mean


@dataclass(frozen=True)
class TierEstimate:
    """One configuration's predicted latencies (inf: the tier cannot keep up)."""

    ttft_s: float
    itl_s: float
    batch: float  # requests a decoding node holds on average
    prefill_load: float  # utilization of the prefill path (prefill nodes or chunks)

    def meets(self, targets: Targets) -> bool:
        return self.ttft_s <= targets.ttft_s and self.itl_s <= targets.itl_s


def decode_batch(step: Callable[[float], float], rate: float, tokens: int, max_batch: int) -> float:
    """The fixed point B = rate x tokens x step(B) (Little's law), or inf past `max_batch`."""
    if tokens <= 0 or rate <= 0:
        return 0.0
    batch = 0.0
    for _ in range(_FIXED_POINT_ROUNDS):
        after = rate * tokens * step(max(batch, 1.0))
        if after > max_batch:
            return math.inf
        if abs(after - batch) < 1e-6:
            break
        batch = after
    return batch


def prefill_tier(
    profile: Profile, work: Workload, targets: Targets, nodes: int
) -> tuple[float, float]:
    """TTFT at the target's quantile through `nodes` prefill nodes, and their utilization."""
    load = work.rate * profile.prefill_s(work.prompt_len) / nodes
    if load >= 1:  # the queue grows without bound: no quantile of a finite run means anything
        return math.inf, load
    arrivals = planner_sim.poisson_arrivals(work.rate)
    ttfts = planner_sim.prefill_tier_ttfts(profile, work.prompt_len, nodes, arrivals)
    return float(np.quantile(ttfts, targets.quantile)), load


def decode_tier(profile: Profile, work: Workload, nodes: int) -> tuple[float, float]:
    """ITL and the batch a decode node holds, with `nodes` decode nodes."""
    context = work.prompt_len + work.output_len / 2

    def step(batch: float) -> float:
        return profile.step(batch, context)

    decodes = work.output_len - 1  # the first token comes from the prefill node
    batch = decode_batch(step, work.rate / nodes, decodes, profile.max_batch)
    itl = math.inf if math.isinf(batch) else (step(batch) if decodes > 0 else 0.0)
    return itl, batch


def disaggregated(
    profile: Profile, work: Workload, targets: Targets, prefill_nodes: int, decode_nodes: int
) -> TierEstimate:
    ttft, load = prefill_tier(profile, work, targets, prefill_nodes)
    itl, batch = decode_tier(profile, work, decode_nodes)
    return TierEstimate(ttft, itl, batch, load)


def colocated(profile: Profile, work: Workload, targets: Targets, nodes: int) -> TierEstimate:
    """Each of `nodes` colocated nodes takes rate / nodes (a Poisson stream split at random is
    Poisson)."""
    rate = work.rate / nodes
    full, rest = divmod(work.prompt_len, profile.chunk_tokens)
    per_prompt = full * profile.chunk_extra_s(profile.chunk_tokens) + (
        profile.chunk_extra_s(rest) if rest else 0.0
    )
    rho = rate * per_prompt  # the share of the node's time its prompts' chunks take
    if rho >= 1:
        return TierEstimate(math.inf, math.inf, math.inf, rho)
    run = planner_sim.colocated_node(
        profile, work.prompt_len, work.output_len, planner_sim.poisson_arrivals(rate)
    )
    itl = float(np.mean(run.itls)) if work.output_len > 1 else 0.0
    ttft = float(np.quantile(run.ttfts, targets.quantile))
    return TierEstimate(ttft, itl, run.mean_batch, rho)
