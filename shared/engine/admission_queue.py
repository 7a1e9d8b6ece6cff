"""The admission queue: requests that cannot get their KV blocks yet wait here holding nothing.

Pure bookkeeping (no torch, no I/O, no clock of its own: callers pass `now`). Strict FIFO: the
head is admitted first and nothing passes it, so no request waits for ever behind later ones
(preempted requests go back to the *front*, since they were admitted before anything behind
them). Each entry keeps its own deadline; a bounded length turns overload into a fast refusal
with a retry hint instead of an unbounded backlog.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# how many recent admissions the drain-rate estimate behind the retry hint looks at
_RATE_WINDOW = 64
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


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

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


class AdmissionQueue(Generic[T]):
    def __init__(self, max_queued: int):
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        self.max_queued = max_queued
        self._entries: OrderedDict[str, QueueEntry[T]] = OrderedDict()
        self._admitted_at: deque[float] = deque(maxlen=_RATE_WINDOW)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def push(self, key: str, item: T, now: float, deadline: float | None = None) -> None:
        """Append at the tail; raises QueueFull past the bound (the request is not queued)."""
        assert key not in self._entries, f"{key} queued twice"
        if len(self._entries) >= self.max_queued:
            hint = self.retry_after(now)
            raise QueueFull(
                f"admission queue is full ({len(self._entries)} requests queued, "
                f"max_queued {self.max_queued}); retry after about {hint}s",
                hint,
            )
        self._entries[key] = QueueEntry(key, item, now, deadline)

    def push_front(self, key: str, item: T, now: float, deadline: float | None = None) -> None:
        """Re-queue at the head (a preempted request), past the bound: it was admitted once
        already, and refusing it now would drop work in flight."""
        assert key not in self._entries, f"{key} queued twice"
        self._entries[key] = QueueEntry(key, item, now, deadline)
        self._entries.move_to_end(key, last=False)

    def remove(self, key: str) -> QueueEntry[T] | None:
        """Cancel: the entry leaves the queue (it held nothing, so nothing is freed)."""
        return self._entries.pop(key, None)

    def pop_expired(self, now: float) -> list[QueueEntry[T]]:
        expired = [e for e in self._entries.values() if e.expired(now)]
        for e in expired:
            del self._entries[e.key]
        return expired

    def head(self) -> QueueEntry[T] | None:
        return next(iter(self._entries.values()), None)

    def admit(self, try_admit: Callable[[QueueEntry[T]], bool], now: float) -> list[QueueEntry[T]]:
        """Offer the head to `try_admit` while it accepts (it takes the resources and returns
        True, or takes nothing and returns False); stops at the first refusal so that nothing
        passes the head. Returns the admitted entries, oldest first."""
        admitted: list[QueueEntry[T]] = []
        while self._entries:
            entry = next(iter(self._entries.values()))
            if not try_admit(entry):
                break
            del self._entries[entry.key]
            self._admitted_at.append(now)
            admitted.append(entry)
        return admitted

    def retry_after(self, now: float) -> int:
        """Seconds until the queue has likely drained by one bound's worth: its length over
        the recent admission rate, clamped to [1, 60]."""
        if len(self._admitted_at) < 2 or now <= self._admitted_at[0]:
            return MIN_RETRY_AFTER_S
        rate = len(self._admitted_at) / (now - self._admitted_at[0])
        wait = math.ceil(max(1, len(self._entries)) / rate)
        return max(MIN_RETRY_AFTER_S, min(MAX_RETRY_AFTER_S, wait))
