"""Discrete-event simulation of the prefill tier and of a colocated node for `pdserve plan`.

Why simulate: a prefill node does not serve one prompt at a time. Its scheduler takes every
prompt waiting when a step starts, up to its token budget, into that step, and each of them gets
its first token when the whole step ends: a Poisson burst is prefilled as one batch. Queueing
formulas (M/D/c) assume one prompt per server and are optimistic at the TTFT quantile for
exactly that reason. A colocated node interleaves prompt chunks with decode steps, and the
prompts' and the decodes' latencies depend on each other step by step. DistServe's placement
search estimates SLO attainment the same way, by simulating the tiers on profiled costs.

Both replay a seeded Poisson arrival sequence through the engine's scheduling rules on the
profiled costs (planner_profile.Profile): deterministic, well under a second.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pdserve.planner_profile import Profile

SIM_REQUESTS = 2000  # simulated arrivals: the p90 within a few percent
SIM_SEED = 2024


def poisson_arrivals(rate: float, count: int = SIM_REQUESTS, seed: int = SIM_SEED) -> np.ndarray:
    """Arrival times (s) of `count` requests at `rate` per second."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, count)
    return np.cumsum(gaps)


@dataclass
class _PrefillNode:
    free_at: float = 0.0  # when its current step ends
    waiting: deque[tuple[int, float]] = field(default_factory=deque)  # (request, arrival)
    queued_s: float = 0.0  # compute owed to the waiting prompts

    def advance(self, until: float, cost: float, per_step: int, done: np.ndarray) -> None:
        """Run the steps that start by `until`: each takes the prompts waiting at its start
        (FCFS, at most `per_step`) and ends after their summed compute."""
        while self.waiting and max(self.free_at, self.waiting[0][1]) <= until:
            start = max(self.free_at, self.waiting[0][1])
            batch: list[int] = []
            while self.waiting and self.waiting[0][1] <= start and len(batch) < per_step:
                batch.append(self.waiting.popleft()[0])
            self.free_at = start + cost * len(batch)
            self.queued_s -= cost * len(batch)
            done[batch] = self.free_at

    def owed(self, now: float) -> float:
        return max(0.0, self.free_at - now) + self.queued_s


def prefill_tier_ttfts(
    profile: Profile, prompt_len: int, nodes: int, arrivals: np.ndarray
) -> np.ndarray:
    """TTFT of every request through `nodes` prefill nodes: the wait for a step, the step, then
    what the P/D path adds (the hop and the KV push, profiled). A prompt goes to the node owing
    the least compute (the decode nodes route by outstanding prompt tokens). A step's cost is
    the sum of its prompts' (batching them saves little compute on a CPU; on a GPU this errs
    on the slow side)."""
    cost = profile.prefill_s(prompt_len)
    per_step = max(1, profile.prefill_budget_tokens // max(1, prompt_len))
    done = np.zeros(len(arrivals))
    tier = [_PrefillNode() for _ in range(nodes)]
    for i, at in enumerate(arrivals):
        for node in tier:
            if node.waiting:
                node.advance(at, cost, per_step, done)
        node = min(tier, key=lambda n: n.owed(at))
        node.waiting.append((i, float(at)))
        node.queued_s += cost
    for node in tier:
        node.advance(float("inf"), cost, per_step, done)
    return done - arrivals + profile.transfer_s(prompt_len)


@dataclass(frozen=True)
class ColocatedRun:
    ttfts: np.ndarray  # s, per request
    itls: np.ndarray  # s, per request: the mean gap between its tokens (its TPOT)
    mean_batch: float  # decoding requests per busy step


def colocated_node(
    profile: Profile, prompt_len: int, output_len: int, arrivals: np.ndarray
) -> ColocatedRun:
    """One colocated node: each step decodes every running request by one token and gives the
    rest of the step's token budget to the oldest prompts still prefilling (chunked prefill,
    FCFS, while the batch has room); a step costs the profiled decode step at its batch plus
    each chunk's profiled extra cost; a prompt's first token comes at the end of the step with
    its last chunk, its others one per step after."""
    n = len(arrivals)
    context = prompt_len + output_len / 2
    step_s = [0.0] + [profile.step(b, context) for b in range(1, profile.max_batch + 1)]
    chunk_s: dict[int, float] = {}  # the profile's interpolation, once per chunk size
    first, last = np.zeros(n), np.zeros(n)
    left = np.full(n, prompt_len)  # prompt tokens still to prefill
    ends: list[tuple[int, int]] = []  # heap of (the step with its last token, request)
    prefilling: deque[int] = deque()
    now, step, arrived, batched = 0.0, 0, 0, 0
    while arrived < n or prefilling or ends:
        if not prefilling and not ends:
            now = max(now, float(arrivals[arrived]))
        while arrived < n and arrivals[arrived] <= now:
            prefilling.append(arrived)
            arrived += 1
        decoding = len(ends)
        seconds = step_s[decoding]
        room, seats = profile.chunk_tokens - decoding, profile.max_batch - decoding
        completed: list[int] = []
        for r in prefilling:
            if room <= 0 or seats <= 0:
                break
            chunk = min(room, int(left[r]))
            if chunk not in chunk_s:
                chunk_s[chunk] = profile.chunk_extra_s(chunk)
            seconds += chunk_s[chunk]
            left[r] -= chunk
            room, seats = room - chunk, seats - 1
            if left[r] == 0:
                completed.append(r)
        now += seconds
        batched += decoding
        while ends and ends[0][0] == step:
            last[heapq.heappop(ends)[1]] = now
        for r in completed:
            prefilling.popleft()  # FCFS: the completed ones are at the front
            first[r] = last[r] = now
            if output_len > 1:
                heapq.heappush(ends, (step + output_len - 1, r))
        step += 1
    gaps = (last - first) / max(1, output_len - 1)
    return ColocatedRun(first - arrivals, gaps, batched / max(1, step))
