"""The mRoPE delta pool: each seated request's position delta (shared/model/mrope.py), read by
seat when a step builds its rope positions (docs/seat-system.md §10).

Sized from the seat pool, plus one scratch row that belongs to no request: padding rows (a CUDA
graph's dummy sequences) and models without images read it, and it is always 0. A request's row
is written when it takes its seat (on a decode node, with the delta its KV header brought) and
cleared before the seat goes back, so a seat's next request never reads an old delta. Pure
bookkeeping: no torch, no I/O.
"""

from __future__ import annotations


class MropeDeltaPool:
    def __init__(self, num_seats: int) -> None:
        if num_seats <= 0:
            raise ValueError(f"num_seats must be positive, got {num_seats}")
        self.scratch_row = num_seats
        self._deltas = [0] * (num_seats + 1)
        self._owners: list[str | None] = [None] * (num_seats + 1)

    def write(self, seat: int, request_id: str, delta: int) -> None:
        if not 0 <= seat < self.scratch_row:
            raise IndexError(f"seat {seat} outside the pool's {self.scratch_row} seats")
        owner = self._owners[seat]
        assert owner is None or owner == request_id, f"seat {seat}'s delta is {owner}'s"
        self._owners[seat] = request_id
        self._deltas[seat] = delta

    def read(self, seat: int | None) -> int:
        """The delta at `seat`; a request without one reads the scratch row."""
        return self._deltas[self.scratch_row if seat is None else seat]

    def clear(self, seat: int) -> None:
        self._owners[seat] = None
        self._deltas[seat] = 0

    def check_conservation(self) -> None:
        """Every row back (no owner, delta 0), the scratch row never owned."""
        held = [(seat, owner) for seat, owner in enumerate(self._owners) if owner is not None]
        dirty = [seat for seat, delta in enumerate(self._deltas) if delta != 0]
        assert not held and not dirty, f"mRoPE delta rows held {held[:10]}, non-zero {dirty[:10]}"
