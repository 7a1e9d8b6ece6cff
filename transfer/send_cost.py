"""What one KV message costs this sender, measured from its own completed sends.

Each message costs a fixed part (a header and a payload through UCX, a tag, completions, the
receiver's wake-up and validation) plus its bytes over the wire's bandwidth. Fitting
`seconds = fixed + bytes / bandwidth` to recent sends gives the size at which the fixed part
stops mattering: `min_message_bytes`, below which the layer-wise push coalesces a chunk's layers
into one message (prefill_node/push.py). Measured, not assumed: shared memory, TCP across hosts
and a loaded core differ by orders of magnitude in both terms.

A message's time is its service time: from when it could first move (posted, or the previous
message of the same sender completed, whichever is later) to its completion, so messages queued
behind others in the send window are not charged for their wait.
"""

from __future__ import annotations

from collections import deque

import numpy as np

SAMPLES = 256  # recent messages the fit uses (two floats each)
MIN_SAMPLES = 8
# the fit needs messages of different sizes: the largest at least this many times the smallest
MIN_SIZE_SPREAD = 4.0
# payload time / total time a coalesced message reaches at `min_message_bytes`: 0.8 -> 4x the
# size whose payload time equals the fixed cost
TARGET_EFFICIENCY = 0.8


class SendCost:
    """A least-squares fit of message time against bytes over the last SAMPLES messages."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=SAMPLES)
        self._last_done = 0.0
        self.fixed_s: float | None = None  # per-message cost, seconds
        self.bandwidth: float | None = None  # bytes per second
        self._since_fit = 0

    def observe(self, nbytes: int, posted_at: float, done_at: float) -> None:
        """A message of `nbytes` posted at `posted_at` completed at `done_at` (monotonic)."""
        start = max(posted_at, self._last_done)
        self._last_done = max(self._last_done, done_at)
        if done_at > start:
            self._samples.append((float(nbytes), done_at - start))
            self._since_fit += 1
        if self._since_fit >= MIN_SAMPLES:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        if len(self._samples) < MIN_SAMPLES:
            return
        data = np.asarray(self._samples)
        sizes, seconds = data[:, 0], data[:, 1]
        if sizes.max() < MIN_SIZE_SPREAD * max(sizes.min(), 1.0):
            return  # one size only: fixed cost and bandwidth cannot be told apart
        slope, intercept = np.polyfit(sizes, seconds, 1)
        if slope <= 0:
            return  # noise swamped the bytes' share: keep the last estimate
        self.bandwidth = 1.0 / slope
        self.fixed_s = max(0.0, float(intercept))

    @property
    def min_message_bytes(self) -> int:
        """The smallest payload worth a message of its own (0 until measured)."""
        if self.fixed_s is None or self.bandwidth is None:
            return 0
        ratio = TARGET_EFFICIENCY / (1.0 - TARGET_EFFICIENCY)
        return int(self.fixed_s * self.bandwidth * ratio)
