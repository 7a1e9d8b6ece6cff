"""The blocks of a prefill node's embedding landing area: which are granted to an encoder's push
and which are free. Bookkeeping only (no torch, no I/O); the area itself is EmbeddingLanding's."""

from __future__ import annotations

from collections.abc import Sequence


class LandingBlocks:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a landing area needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: low ids first
        self._granted: set[int] = set()
        self.quarantined: set[int] = set()  # a write into them may still be posted: never reused

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """`n` free blocks, granted from now; None when fewer are free (nothing taken)."""
        if not 1 <= n <= len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        self._granted.update(ids)
        return ids

    def give_back(self, ids: Sequence[int]) -> None:
        """Blocks no write can reach any more, free for the next grant."""
        self._release(ids)
        self._free.extend(reversed(ids))

    def quarantine(self, ids: Sequence[int]) -> None:
        """Blocks whose transfer could not be fenced: out of use for the process's life."""
        self._release(ids)
        self.quarantined.update(ids)

    def _release(self, ids: Sequence[int]) -> None:
        stray = [b for b in ids if b not in self._granted]
        if stray:
            raise ValueError(f"landing blocks {stray[:8]} were not granted")
        self._granted.difference_update(ids)

    def check_conservation(self) -> None:
        """Every block free or quarantined, none granted (raises AssertionError otherwise)."""
        held = len(self._free) + len(self.quarantined)
        assert not self._granted, f"landing blocks still granted: {sorted(self._granted)[:8]}"
        assert held == self.num_blocks, f"{held} of {self.num_blocks} landing blocks accounted"
