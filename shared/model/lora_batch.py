"""Which tokens of a step run which LoRA adapter, grouped by adapter for the batched delta
(shared/model/lora_bank.py): built once per step on the host, read by every layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraBatch:
    active: tuple[int, ...]  # the slots that have tokens this step, ascending
    active_index: torch.Tensor  # [k] the same, on the device
    rows: torch.Tensor  # [M] the tokens (rows of the batch's [T]) that run an adapter
    group: torch.Tensor  # [M] each one's index into `active`
    position: torch.Tensor  # [M] its place among its group's tokens
    longest: int  # the most tokens any active slot has


def lora_batch(
    seq_slots: Sequence[int], query_lens: Sequence[int], device: torch.device
) -> LoraBatch | None:
    """The grouping of a batch whose sequence i runs slot `seq_slots[i]` (-1: the base model)
    over its `query_lens[i]` new tokens; None when every sequence runs the base model, so such a
    batch takes the model's unchanged path."""
    active = tuple(sorted({s for s in seq_slots if s >= 0}))
    if not active:
        return None
    index = {slot: g for g, slot in enumerate(active)}
    rows, group, position = [], [], []
    filled = [0] * len(active)
    start = 0
    for slot, n in zip(seq_slots, query_lens, strict=True):
        if slot >= 0:
            g = index[slot]
            rows.extend(range(start, start + n))
            group.extend([g] * n)
            position.extend(range(filled[g], filled[g] + n))
            filled[g] += n
        start += n
    # one copy to the device for the three token indices
    rows_t, group_t, position_t = torch.tensor([rows, group, position]).to(device)
    active_t = torch.tensor(active, dtype=torch.long).to(device)
    return LoraBatch(active, active_t, rows_t, group_t, position_t, max(filled))
