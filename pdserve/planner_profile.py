"""The profile `pdserve bench profile` writes (profile.json) as `pdserve plan` reads it: each
measured curve validated, interpolated piecewise linearly and extrapolated never falling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from prefill_node.config import PREFILL_MAX_NUM_TOKENS

PROFILE_SCHEMA = "pdserve-profile"
PROFILE_VERSION = 1


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
    # a prefill node's per-step token budget: the prompts waiting when a step starts share it
    prefill_budget_tokens: int = PREFILL_MAX_NUM_TOKENS

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
        # absent in profiles taken before it was recorded: the prefill node's default then
        budget = data.get("prefill_budget_tokens", PREFILL_MAX_NUM_TOKENS)
        if not isinstance(budget, int) or budget < 1:
            raise ProfileError(
                f"profile field prefill_budget_tokens must be a positive int, got {budget!r}"
            )
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
            prefill_budget_tokens=budget,
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
