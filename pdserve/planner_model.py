"""A model of the serving system for `pdserve plan`: TTFT and ITL of a node count, from a profile.

Prefill tier (DistServe): each prefill node serves one prompt at a time in `prefill_s(P)`, the
decode nodes route to the least loaded one, so the tier is an M/D/c queue fed by Poisson
arrivals. Its waiting-time quantile is taken as half the M/M/c one (Erlang C with the tail
P(W > t) = C exp(-(c/S - rate) t); deterministic service halves the wait). TTFT = wait + prefill
+ transfer (what the P/D path adds to the prefill, measured: the RPC hop and the KV push).
Decode tier: by Little's law a decode node holds B = rate/n x (output - 1) x step(B, context)
requests; the fixed point B gives the ITL, step(B), which must meet the target within the
largest measured batch. Colocated node: prompts are prefilled in chunks inside decode steps, each
chunk adding its measured local-prefill cost, so decode progress runs at (1 - rho) of the time
(rho: the share spent on those chunks): ITL = step(B) / (1 - rho); its prompts queue as an M/D/1
whose service is a prompt's chunks with the decode steps they ride on. ITL here is the mean gap
between a request's tokens (its TPOT, what `bench serve --goodput tpot:MS` checks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

PROFILE_SCHEMA = "pdserve-profile"
PROFILE_VERSION = 1
_FIXED_POINT_ROUNDS = 200


class ProfileError(ValueError):
    """The profile is not one `pdserve bench profile` writes (the message names the field)."""


def _curve(data: dict[str, Any], key: str, x: str, y: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        xs, ys = np.asarray(data[key][x], dtype=float), np.asarray(data[key][y], dtype=float)
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"profile field {key}.{x}/{y}: {e!r}") from e
    if xs.ndim != 1 or xs.shape != ys.shape or len(xs) < 1 or np.any(np.diff(xs) <= 0):
        raise ProfileError(f"profile field {key}: {x} must increase and match {y} in length")
    if np.any(ys < 0):
        raise ProfileError(f"profile field {key}.{y}: negative seconds")
    return xs, ys


def _interp(xs: np.ndarray, ys: np.ndarray, x: float) -> float:
    """Piecewise linear (one point: constant); past the last point, the line through the last
    two, never falling: a longer prompt or a larger batch does not get faster."""
    if x <= xs[-1] or len(xs) == 1:
        return float(np.interp(x, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(ys[-1] + max(slope, 0.0) * (x - xs[-1]))


@dataclass(frozen=True)
class Profile:
    """What `pdserve bench profile` measured (profile.json, docs in pdserve/bench/profile.py)."""

    prefill: tuple[np.ndarray, np.ndarray]  # prompt tokens -> prefill node seconds
    transfer: tuple[np.ndarray, np.ndarray]  # prompt tokens -> P/D TTFT - prefill compute
    local_prefill: tuple[np.ndarray, np.ndarray]  # chunk tokens -> extra seconds in a step
    contexts: np.ndarray  # decode context lengths measured
    batches: np.ndarray  # decode batch sizes measured
    step_s: np.ndarray  # [context, batch] -> decode step seconds
    chunk_tokens: int  # a colocated node's per-step token budget

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        if data.get("schema") != PROFILE_SCHEMA or data.get("version") != PROFILE_VERSION:
            raise ProfileError(
                f"not a {PROFILE_SCHEMA} version {PROFILE_VERSION} file (schema "
                f"{data.get('schema')!r}, version {data.get('version')!r})"
            )
        decode = data.get("decode") or {}
        contexts = np.asarray(decode.get("contexts", []), dtype=float)
        batches = np.asarray(decode.get("batches", []), dtype=float)
        step_s = np.asarray(decode.get("step_s", []), dtype=float)
        if step_s.shape != (len(contexts), len(batches)) or step_s.size == 0:
            raise ProfileError("profile field decode.step_s must be [contexts][batches]")
        if np.any(np.diff(contexts) <= 0) or np.any(np.diff(batches) <= 0):
            raise ProfileError("profile fields decode.contexts and decode.batches must increase")
        chunk = data.get("chunk_tokens")
        if not isinstance(chunk, int) or chunk < 1:
            raise ProfileError(f"profile field chunk_tokens must be a positive int, got {chunk!r}")
        # a larger batch or context is never faster: a dip is noise of a shared machine
        step_s = np.maximum.accumulate(np.maximum.accumulate(step_s, axis=1), axis=0)
        return cls(
            prefill=_curve(data, "prefill", "tokens", "seconds"),
            transfer=_curve(data, "transfer", "tokens", "seconds"),
            local_prefill=_curve(data, "local_prefill", "tokens", "extra_s"),
            contexts=contexts,
            batches=batches,
            step_s=step_s,
            chunk_tokens=chunk,
        )

    @property
    def max_batch(self) -> int:
        return int(self.batches[-1])

    def prefill_s(self, tokens: float) -> float:
        return _interp(*self.prefill, tokens)

    def transfer_s(self, tokens: float) -> float:
        return max(0.0, _interp(*self.transfer, tokens))

    def chunk_extra_s(self, tokens: float) -> float:
        return _interp(*self.local_prefill, tokens)

    def step(self, batch: float, context: float) -> float:
        """Decode step seconds at a (fractional) batch: linear in batch and in context."""
        by_context = [_interp(self.batches, row, max(batch, 1.0)) for row in self.step_s]
        return _interp(self.contexts, np.asarray(by_context), context)


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


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in M/M/c (`offered` = rate x service time < c)."""
    b = 1.0
    for k in range(1, servers + 1):  # Erlang B by its recursion (no factorials to overflow)
        b = offered * b / (k + offered * b)
    rho = offered / servers
    return b / (1 - rho * (1 - b))


def mdc_wait_quantile(rate: float, service_s: float, servers: int, quantile: float) -> float:
    """The `quantile` of the queueing wait of M/D/c: half that of M/M/c (inf when saturated)."""
    if rate <= 0:
        return 0.0
    offered = rate * service_s
    if offered >= servers:
        return math.inf
    waits = erlang_c(servers, offered)
    if waits <= 1 - quantile:
        return 0.0
    return 0.5 * math.log(waits / (1 - quantile)) / (servers / service_s - rate)


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


def disaggregated(
    profile: Profile, work: Workload, targets: Targets, prefill_nodes: int, decode_nodes: int
) -> TierEstimate:
    service = profile.prefill_s(work.prompt_len)
    wait = mdc_wait_quantile(work.rate, service, prefill_nodes, targets.quantile)
    ttft = wait + service + profile.transfer_s(work.prompt_len)
    context = work.prompt_len + work.output_len / 2

    def step(batch: float) -> float:
        return profile.step(batch, context)

    decodes = work.output_len - 1  # the first token comes from the prefill node
    batch = decode_batch(step, work.rate / decode_nodes, decodes, profile.max_batch)
    itl = math.inf if math.isinf(batch) else (step(batch) if decodes > 0 else 0.0)
    return TierEstimate(ttft, itl, batch, work.rate * service / prefill_nodes)


def colocated(profile: Profile, work: Workload, targets: Targets, nodes: int) -> TierEstimate:
    rate = work.rate / nodes
    chunks = _chunks(work.prompt_len, profile.chunk_tokens)
    extra = sum(profile.chunk_extra_s(c) for c in chunks)  # a prompt's prefill work, s
    rho = rate * extra
    if rho >= 1:
        return TierEstimate(math.inf, math.inf, math.inf, rho)
    context = work.prompt_len + work.output_len / 2

    def step(batch: float) -> float:  # decode progress runs 1 - rho of the time
        return profile.step(batch, context) / (1 - rho)

    decodes = work.output_len - 1
    batch = decode_batch(step, rate, decodes, profile.max_batch)
    if math.isinf(batch):
        return TierEstimate(math.inf, math.inf, batch, rho)
    itl = step(batch) if decodes > 0 else 0.0
    service = extra + len(chunks) * profile.step(max(batch, 1.0), context)
    ttft = mdc_wait_quantile(rate, service, 1, targets.quantile) + service
    return TierEstimate(ttft, itl, batch, rho)


def _chunks(tokens: int, budget: int) -> list[int]:
    full, rest = divmod(tokens, budget)
    return [budget] * full + ([rest] if rest else [])
