"""The per-step batch description the model and attention read (built once per engine step).

A `ForwardBatch` holds every index the model needs, as tensors moved to the device in one copy,
so each layer does a fixed number of tensor ops however many sequences are batched:

* `slot_mapping[t]`: where new token t's K/V goes in one layer's flat K (or V) plane.
* Sequences are split into a few *groups* (shared/model/attention_groups.py): decode steps,
  fresh prefills and continued prefill chunks apart, and sequences of very different lengths
  apart, so padding stays bounded. A uniform decode batch is one group, and every decode batch
  is where the paged decode kernel reads each sequence's own context (`ragged_decode`). Each
  group runs one attention call per layer (shared/model/attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shared.cdiv import cdiv
from shared.model.attention_groups import AttentionGroup, group_tensors, split_groups
from shared.model.lora_batch import LoraBatch


@dataclass(frozen=True)
class SeqEntry:
    """One sequence's share of a forward step."""

    token_ids: list[int]  # the NEW tokens to compute this step
    num_computed: int  # tokens already in the KV pool (= position of the first new token)
    block_table: list[int]  # covers at least num_computed + len(token_ids) tokens
    # mRoPE models: [3, len(token_ids)] rope positions of the new tokens when they are not
    # their indices (shared/model/mrope.py); None: the indices
    rope_positions: np.ndarray | None = None
    # mRoPE models, tokens after the prompt (rope_positions None): their rope position is their
    # index plus this (the request's delta), on every axis alike, so one axis carries it: a
    # decode step keeps the [T] positions a captured CUDA graph takes
    rope_offset: int = 0
    # embeddings that replace the token embeddings of some new tokens (an image's): (index of
    # the first of them among the new tokens, [k, hidden] rows)
    embeds: tuple[tuple[int, torch.Tensor], ...] = ()

    @property
    def context_len(self) -> int:
        return self.num_computed + len(self.token_ids)


@dataclass
class ForwardBatch:
    num_seqs: int
    num_tokens: int
    query_lens: list[int]
    context_lens: list[int]
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long, flat slot inside one layer's K (or V) plane
    last_token_index: torch.Tensor  # [B] row of each sequence's last new token in [T]
    groups: list[AttentionGroup]
    block_size: int
    # the tokens that run a LoRA adapter, by adapter; None when no sequence names one
    lora: LoraBatch | None = None
    # what rope turns by when some token's position differs from its index (`positions`):
    # [3, T] mRoPE positions when some token's axes differ, else [T]; None when none differs
    rope_positions: torch.Tensor | None = None
    # rows of [T] whose embeddings are replaced, and their replacements ([R], [R, hidden])
    embed_rows: torch.Tensor | None = None
    embeds: torch.Tensor | None = None

    @property
    def rope_input(self) -> torch.Tensor:
        """What the rope tables are computed from."""
        return self.positions if self.rope_positions is None else self.rope_positions

    @classmethod
    def build(
        cls,
        entries: Sequence[SeqEntry],
        block_size: int,
        device: torch.device | str,
        ragged_decode: bool = False,
    ) -> ForwardBatch:
        """`ragged_decode`: decode attention reads each sequence's own context (the paged decode
        kernel), so decode rows form one group whatever their lengths (`split_groups`)."""
        _validate_entries(entries, block_size)
        query_lens = [len(e.token_ids) for e in entries]
        context_lens = [e.context_len for e in entries]
        seqs = _SeqTensors.of(entries, context_lens, block_size)

        tensors = _token_tensors(entries, seqs, block_size)
        rope = _rope_positions(entries, tensors["positions"])
        if rope is not None:
            tensors["rope_positions"] = rope
        group_ids = split_groups(query_lens, context_lens, ragged_decode)
        fresh = [all(entries[i].num_computed == 0 for i in ids) for ids in group_ids]
        group_shapes = []
        for g, ids in enumerate(group_ids):
            shape, tensors_of_group = group_tensors(ids, seqs, block_size, fresh[g])
            group_shapes.append(shape)
            tensors.update({f"{g}.{name}": t for name, t in tensors_of_group.items()})
        on_device = _to_device(tensors, torch.device(device))

        groups = [
            AttentionGroup(
                seq_ids=ids,
                query_len=q_max,
                kv_len=kv_max,
                fresh=fresh[g],
                kv_blocks=on_device.get(f"{g}.kv_blocks"),
                query_pos=on_device[f"{g}.query_pos"],
                kv_pos=on_device[f"{g}.kv_pos"],
                query_rows=on_device.get(f"{g}.query_rows"),
                query_valid=on_device.get(f"{g}.query_valid"),
                token_rows=on_device.get(f"{g}.token_rows"),
                seq_starts=on_device.get(f"{g}.seq_starts"),
                seq_qlens=on_device.get(f"{g}.seq_qlens"),
                seq_computed=on_device.get(f"{g}.seq_computed"),
                block_tables=on_device.get(f"{g}.block_tables"),
            )
            for g, (ids, (q_max, kv_max)) in enumerate(zip(group_ids, group_shapes, strict=True))
        ]
        return cls(
            num_seqs=len(entries),
            num_tokens=sum(query_lens),
            query_lens=query_lens,
            context_lens=context_lens,
            input_ids=on_device["input_ids"],
            positions=on_device["positions"],
            slot_mapping=on_device["slot_mapping"],
            last_token_index=on_device["last_token_index"],
            groups=groups,
            block_size=block_size,
            rope_positions=on_device.get("rope_positions"),
            **_embeds(entries, device),
        )


def _validate_entries(entries: Sequence[SeqEntry], block_size: int) -> None:
    if not entries:
        raise ValueError("ForwardBatch needs at least one sequence")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    for i, entry in enumerate(entries):
        _validate_entry(i, entry, block_size)


def _validate_entry(i: int, entry: SeqEntry, block_size: int) -> None:
    if not entry.token_ids:
        raise ValueError(f"sequence {i}: no new tokens to compute")
    if entry.num_computed < 0:
        raise ValueError(f"sequence {i}: num_computed must be >= 0, got {entry.num_computed}")
    needed = cdiv(entry.context_len, block_size)
    if len(entry.block_table) < needed:
        raise ValueError(
            f"sequence {i}: block table has {len(entry.block_table)} blocks but "
            f"{entry.context_len} tokens need {needed} of size {block_size}"
        )


@dataclass
class _SeqTensors:
    """Per-sequence CPU tensors the token and group indices derive from."""

    q_lens: torch.Tensor  # [B]
    num_computed: torch.Tensor  # [B]
    starts: torch.Tensor  # [B] row of each sequence's first new token in [T]
    tables: torch.Tensor  # [B, max_blocks_in_use], padded with each row's first block

    @classmethod
    def of(
        cls, entries: Sequence[SeqEntry], context_lens: list[int], block_size: int
    ) -> _SeqTensors:
        q_lens = torch.tensor([len(e.token_ids) for e in entries], dtype=torch.long)
        used = [cdiv(n, block_size) for n in context_lens]
        width = max(used)
        rows = [
            e.block_table[:n] + [e.block_table[0]] * (width - n)
            for e, n in zip(entries, used, strict=True)
        ]
        return cls(
            q_lens=q_lens,
            num_computed=torch.tensor([e.num_computed for e in entries], dtype=torch.long),
            starts=torch.cumsum(q_lens, 0) - q_lens,
            tables=torch.tensor(rows, dtype=torch.long),
        )


def _token_tensors(
    entries: Sequence[SeqEntry], seqs: _SeqTensors, block_size: int
) -> dict[str, torch.Tensor]:
    seq_of_token = torch.repeat_interleave(torch.arange(len(entries)), seqs.q_lens)
    offset_in_seq = torch.arange(seq_of_token.numel()) - seqs.starts[seq_of_token]
    positions = seqs.num_computed[seq_of_token] + offset_in_seq
    blocks = seqs.tables[seq_of_token, positions // block_size]
    return {
        "input_ids": torch.tensor([t for e in entries for t in e.token_ids], dtype=torch.long),
        "positions": positions,
        "slot_mapping": blocks * block_size + positions % block_size,
        "last_token_index": seqs.starts + seqs.q_lens - 1,
    }


def _rope_positions(entries: Sequence[SeqEntry], positions: torch.Tensor) -> torch.Tensor | None:
    """[3, T] when any entry carries its own rope positions: the others' are their indices
    (plus their offset) on every axis (text tokens advance all three together); [T] when some
    entry only has an offset; None when every token's is its index."""
    three = any(e.rope_positions is not None for e in entries)
    if not three and all(e.rope_offset == 0 for e in entries):
        return None
    rope = positions.clone()
    start = 0
    for e in entries:
        rope[start : start + len(e.token_ids)] += e.rope_offset
        start += len(e.token_ids)
    if not three:
        return rope
    rope = rope.expand(3, -1).clone()
    start = 0
    for e in entries:
        n = len(e.token_ids)
        if e.rope_positions is not None:
            rope[:, start : start + n] = torch.from_numpy(e.rope_positions)
        start += n
    return rope


def _embeds(entries: Sequence[SeqEntry], device: torch.device | str) -> dict[str, torch.Tensor]:
    """`embed_rows` and `embeds` for the entries' replaced embeddings; nothing when none."""
    rows: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    start = 0
    for e in entries:
        for offset, tensor in e.embeds:
            first = start + offset
            rows.append(torch.arange(first, first + tensor.shape[0]))
            values.append(tensor)
        start += len(e.token_ids)
    if not rows:
        return {}
    return {
        "embed_rows": torch.cat(rows).to(device),
        "embeds": torch.cat(values).to(device),
    }


def _to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Move the step's index tensors (all int64) with ONE host-to-device copy."""
    if device.type == "cpu":
        return tensors
    names = list(tensors)
    flat = torch.cat([tensors[n].reshape(-1) for n in names]).to(device)
    parts = flat.split([tensors[n].numel() for n in names])
    return {n: part.view(tensors[n].shape) for n, part in zip(names, parts, strict=True)}
