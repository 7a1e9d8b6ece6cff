"""The admission queue: requests that cannot get their KV blocks yet wait here holding nothing.

Pure bookkeeping (no torch, no I/O, no clock of its own: callers pass `now`). The head is
admitted first and nothing passes it; preempted requests go back to the *front*, since they were
admitted before anything behind them. Each entry keeps its own deadline; a bounded length turns
overload into a fast refusal with a retry hint instead of an unbounded backlog.

Order: by priority (lower value first, vLLM's convention), aged by the wait. An entry's effective
priority is `priority - waited / aging_s`, so it improves by one level every `aging_s` seconds.
Comparing two entries, `now` cancels out: the order is that of the fixed key
`enqueued_at + priority * aging_s` (a virtual arrival time), ties in arrival order. With every
priority 0 this is strict FIFO.

Starvation bound: an entry A (priority p, queued at t) is passed by a later entry B (priority q,
queued at t + d) only when `t + d + q * aging_s < t + p * aging_s`, i.e. `d < (p - q) * aging_s`.
Priorities lie in [MIN_PRIORITY, MAX_PRIORITY] (service_level.py), so nothing queued more than
`(p - MIN_PRIORITY) * aging_s` seconds after A is ever admitted before A: A waits at most that long
plus the time to admit what was already queued by then.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# how many recent admissions the drain-rate estimate behind the retry hint looks at
_RATE_WINDOW = 64
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60
DEFAULT_AGING_S = 1.0  # seconds of waiting worth one priority level


def clamp_retry_after(seconds: float) -> int:
    """A Retry-After hint: `seconds` rounded up, within [MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S]."""
    return max(MIN_RETRY_AFTER_S, min(MAX_RETRY_AFTER_S, math.ceil(seconds)))


class QueueFull(RuntimeError):
    """The queue is at its bound; `retry_after_s` is a hint for when room is likely."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class QueueEntry(Generic[T]):
    key: str
    item: T
    enqueued_at: float
    deadline: float | None  # same clock as `now`; None: no deadline
    priority: int = 0
    # the order: (0 for re-queued at the front, virtual arrival time, arrival sequence)
    order: tuple[int, float, float] = (1, 0.0, 0)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


class AdmissionQueue(Generic[T]):
    def __init__(self, max_queued: int, aging_s: float = DEFAULT_AGING_S):
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        if aging_s <= 0:
            raise ValueError(f"aging_s must be > 0, got {aging_s}")
        self.max_queued = max_queued
        self.aging_s = aging_s
        self._entries: dict[str, QueueEntry[T]] = {}
        self._order: list[tuple[tuple[int, float, float], str]] = []  # sorted: the head first
        self._seq = itertools.count()
        self._admitted_at: deque[float] = deque(maxlen=_RATE_WINDOW)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        """In admission order, the head first."""
        return [key for _, key in self._order]

    def entries(self) -> list[QueueEntry[T]]:
        """In admission order, the head first."""
        return [self._entries[key] for _, key in self._order]

    def order_key(self, now: float, priority: int = 0) -> tuple[int, float, float]:
        """Where an entry pushed now with `priority` would stand (it sorts after equal keys)."""
        return (1, now + priority * self.aging_s, math.inf)

    def push(
        self, key: str, item: T, now: float, deadline: float | None = None, priority: int = 0
    ) -> None:
        """Queue by priority (aged, see the module's docstring); raises QueueFull past the
        bound (the request is not queued)."""
        assert key not in self._entries, f"{key} queued twice"
        if len(self._entries) >= self.max_queued:
            hint = self.retry_after(now)
            raise QueueFull(
                f"admission queue is full ({len(self._entries)} requests queued, "
                f"max_queued {self.max_queued}); retry after about {hint}s",
                hint,
            )
        order = (1, now + priority * self.aging_s, next(self._seq))
        self._insert(QueueEntry(key, item, now, deadline, priority, order))

    def push_front(self, key: str, item: T, now: float, deadline: float | None = None) -> None:
        """Re-queue at the head (a preempted request), past the bound: it was admitted once
        already, and refusing it now would drop work in flight."""
        assert key not in self._entries, f"{key} queued twice"
        self._insert(QueueEntry(key, item, now, deadline, 0, (0, 0.0, -next(self._seq))))

    def _insert(self, entry: QueueEntry[T]) -> None:
        self._entries[entry.key] = entry
        bisect.insort(self._order, (entry.order, entry.key))

    def remove(self, key: str) -> QueueEntry[T] | None:
        """Cancel: the entry leaves the queue (it held nothing, so nothing is freed)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            del self._order[bisect.bisect_left(self._order, (entry.order, key))]
        return entry

    def pop_expired(self, now: float) -> list[QueueEntry[T]]:
        expired = [e for e in self.entries() if e.expired(now)]
        for e in expired:
            self.remove(e.key)
        return expired

    def head(self) -> QueueEntry[T] | None:
        return self._entries[self._order[0][1]] if self._order else None

    def admit(self, try_admit: Callable[[QueueEntry[T]], bool], now: float) -> list[QueueEntry[T]]:
        """Offer the head to `try_admit` while it accepts (it takes the resources and returns
        True, or takes nothing and returns False); stops at the first refusal so that nothing
        passes the head. Returns the admitted entries, head first."""
        admitted: list[QueueEntry[T]] = []
        while self._order:
            entry = self._entries[self._order[0][1]]
            if not try_admit(entry):
                break
            self.remove(entry.key)
            self._admitted_at.append(now)
            admitted.append(entry)
        return admitted

    def admission_rate(self, now: float) -> float | None:
        """Admissions out of the queue per second, over the recent ones (None: too few)."""
        if len(self._admitted_at) < 2 or now <= self._admitted_at[0]:
            return None
        return len(self._admitted_at) / (now - self._admitted_at[0])

    def retry_after(self, now: float) -> int:
        """Seconds until the queue has likely drained by one bound's worth: its length over
        the recent admission rate, clamped to [1, 60]."""
        rate = self.admission_rate(now)
        if rate is None:
            return MIN_RETRY_AFTER_S
        return clamp_retry_after(max(1, len(self._entries)) / rate)
