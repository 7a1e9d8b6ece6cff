"""KV blocks in host memory below the pool: a fixed buffer of block slots, LRU by key, bounded
in bytes from the start (allocated once, as the pool is).

A slot that a request is about to load from is pinned (`pin` / `unpin`): the blocks evicted
while that request is scheduled go to the least recently used unpinned slots, never to it.
What falls out of this tier is handed to `on_drop` (the disk tier below, if any) while its
bytes are still in the slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

Key = bytes
# a key leaving the host tier, and its bytes (valid only during the call)
DropHook = Callable[[Key, torch.Tensor], None]


class HostTier:
    def __init__(self, capacity_bytes: int, block: torch.Tensor, on_drop: DropHook | None = None):
        """`block`: one pool block (its shape and dtype are every slot's)."""
        block_bytes = block.numel() * block.element_size()
        self.num_slots = capacity_bytes // block_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"the host KV tier ({capacity_bytes} bytes) holds no {block_bytes}-byte block: "
                "raise --kv-offload-cpu-gb"
            )
        self.block_bytes = block_bytes
        # pinned host memory lets a CUDA pool copy in and out without a staging copy
        pin = block.is_cuda and torch.cuda.is_available()
        # zeroed now: the page faults of first touch are paid at start, not by the first
        # evictions (a measured 5-10x slower copy into untouched memory on a CPU node)
        self.slots = torch.zeros((self.num_slots, *block.shape), dtype=block.dtype, pin_memory=pin)
        self._free = list(range(self.num_slots))
        self._lru: OrderedDict[Key, int] = OrderedDict()  # key -> slot, oldest first
        self._pins = [0] * self.num_slots
        self._spare: set[Key] = set()  # copies of blocks still in the pool: lost for free
        self.on_drop = on_drop
        self.dropped = 0  # blocks not kept: every slot pinned

    def __contains__(self, key: Key) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def bytes_used(self) -> int:
        return len(self._lru) * self.block_bytes

    def touch(self, keys: Sequence[Key]) -> None:
        """Most recently used: what a request is about to load is the last to go."""
        for key in keys:
            self._lru.move_to_end(key)
            self._spare.discard(key)

    def put(self, keys: Sequence[Key], blocks: torch.Tensor) -> None:
        """Copy `blocks` (stacked along dim 0, one per key) in; known keys are only touched."""
        for i, key in enumerate(keys):
            if key in self._lru:
                self.touch([key])
                continue
            slot = self._take_slot()
            if slot is None:
                self.dropped += 1
                continue
            self.slots[slot].copy_(blocks[i])
            self._lru[key] = slot

    def reserve(self, key: Key) -> int | None:
        """A slot for a spare copy of `key`, pinned: the caller writes its bytes, then unpins.
        A spare copy is of a block still in the pool, so it is the first to go, without a word
        to `on_drop`, and it takes only a free slot or another spare's; `touch` makes it a
        copy like any other (its block has left the pool). None: no such slot now."""
        slot = self._take_slot(spare=True)
        if slot is None:
            return None
        self._lru[key] = slot
        self._lru.move_to_end(key, last=False)
        self._spare.add(key)
        self._pins[slot] += 1
        return slot

    def _take_slot(self, spare: bool = False) -> int | None:
        if self._free:
            return self._free.pop()
        for key, slot in self._lru.items():  # oldest first: the spares, then the rest
            if spare and key not in self._spare:
                return None
            if not self._pins[slot]:
                if key in self._spare:
                    self._spare.discard(key)
                elif self.on_drop is not None:
                    self.on_drop(key, self.slots[slot])
                del self._lru[key]
                return slot
        return None

    def items(self) -> list[tuple[Key, int]]:
        """(key, slot) of every block held, the least recently used first."""
        return list(self._lru.items())

    def slot_of(self, key: Key) -> int:
        return self._lru[key]

    def pin(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self._pins[slot] += 1

    def unpin(self, slots: Sequence[int]) -> None:
        for slot in slots:
            if self._pins[slot] <= 0:
                raise AssertionError(f"unpinning host KV slot {slot} that is not pinned")
            self._pins[slot] -= 1

    @property
    def num_pinned(self) -> int:
        return sum(1 for p in self._pins if p)
