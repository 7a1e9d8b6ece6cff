"""The per-step batch description the model and attention read (built once per engine step).

A `ForwardBatch` holds every index the model needs, as tensors moved to the device in one copy,
so each layer does a fixed number of tensor ops however many sequences are batched:

* `slot_mapping[t]`: where new token t's K/V goes in one layer's flat K (or V) plane.
* Sequences are split into a few *groups* (see `_split_groups`): decode steps, fresh prefills and
  continued prefill chunks apart, and sequences of very different lengths apart, so padding
  stays bounded. A uniform decode batch is one group, and every decode batch is where the paged
  decode kernel reads each sequence's own context (`ragged_decode`). Each group runs one
  attention call per layer (shared/model/attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.cdiv import cdiv
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
class AttentionGroup:
    """Sequences that share one padded SDPA call."""

    seq_ids: list[int]  # indices into the batch's entries, in batch order
    query_len: int  # Qmax: padded number of queries per sequence
    kv_len: int  # Kmax: padded number of keys per sequence
    # Every sequence starts at position 0 (nothing cached): its keys are exactly this step's
    # tokens, so attention uses the fresh K/V (no pool gather, Kmax = Qmax) and, without a
    # window, SDPA's built-in causal mode, which skips the masked half of the work.
    fresh: bool
    # Non-fresh groups: [G * Kmax / block_size] block ids, each sequence's blocks in order padded
    # with its first block (Kmax is a multiple of the block size). Gathering whole blocks moves
    # the same bytes as per-token gathering in far fewer, larger copies.
    kv_blocks: torch.Tensor | None
    query_pos: torch.Tensor  # [G, Qmax] absolute position of each (padded) query
    kv_pos: torch.Tensor  # [Kmax] key positions 0..Kmax-1
    # Flat [G * Qmax] rows of the batch's [T] token axis to gather queries (and, when fresh, keys
    # and values) from; the positions in that padded axis holding real tokens; and which of the
    # T tokens each of those is. All None when the group is the whole batch of decodes: its
    # queries are then tokens 0..T-1 in order.
    query_rows: torch.Tensor | None
    query_valid: torch.Tensor | None
    token_rows: torch.Tensor | None
    # Prefill groups (Qmax > 1), for the paged prefill kernel (shared/model/paged_prefill.py):
    # per sequence, the row of its first query in [T], its number of queries, its cached context
    # (the first query's position), and its block table [G, W]. None in decode groups.
    seq_starts: torch.Tensor | None = None
    seq_qlens: torch.Tensor | None = None
    seq_computed: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    # Additive masks (0 / -inf) per (window, dtype), built on first use and shared by all layers:
    # SDPA would otherwise convert a boolean mask anew in every layer.
    _masks: dict[tuple[int | None, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """[G, 1, Qmax, Kmax] additive mask for a layer with attention `window` (None: full)."""
        cached = self._masks.get((window, dtype))
        if cached is None:
            keys, queries = self.kv_pos[None, None, :], self.query_pos[:, :, None]
            # Keys past a sequence's context (padding blocks, the tail of its last block) sit
            # beyond every one of its queries, so causality alone hides them.
            allowed = keys <= queries
            if window is not None:
                allowed &= keys > queries - window
            cached = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            cached.masked_fill_(~allowed, float("-inf"))
            cached = cached[:, None]
            self._masks[(window, dtype)] = cached
        return cached


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
        kernel), so decode rows form one group whatever their lengths (`_split_groups`)."""
        _validate_entries(entries, block_size)
        query_lens = [len(e.token_ids) for e in entries]
        context_lens = [e.context_len for e in entries]
        seqs = _SeqTensors.of(entries, context_lens, block_size)

        tensors = _token_tensors(entries, seqs, block_size)
        rope = _rope_positions(entries, tensors["positions"])
        if rope is not None:
            tensors["rope_positions"] = rope
        group_ids = _split_groups(query_lens, context_lens, ragged_decode)
        fresh = [all(entries[i].num_computed == 0 for i in ids) for ids in group_ids]
        group_shapes = []
        for g, ids in enumerate(group_ids):
            shape, group_tensors = _group_tensors(ids, seqs, block_size, fresh[g])
            group_shapes.append(shape)
            tensors.update({f"{g}.{name}": t for name, t in group_tensors.items()})
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


# A group may spend at most this multiple of its real attention work on padding before the next
# (shorter) sequence starts a new group. Measured on CPU, decode batch of 32 with contexts spread
# over 16..576: for a 4-layer, 8-head model 1.3 ran 18% faster than one padded group (2.0) and
# beat 1.1 / 1.2 / 1.5; for the 4-head `tiny` model it cost 4% (per-call overhead weighs more
# when heads are few). Uniform batches are one group either way.
MAX_PADDING_FACTOR = 1.3


def _split_groups(
    query_lens: list[int], context_lens: list[int], ragged_decode: bool = False
) -> list[list[int]]:
    """Partition sequences into padded attention groups.

    Three kinds never share a group: decode steps (padding their single query to a chunk's
    length would multiply their work by it), fresh prefills (nothing cached: they take the
    cheaper fresh-K/V causal path) and prefill chunks continuing a cached context. Within a
    kind, sequences are taken in decreasing order of work (queries x keys) and a new group starts
    when adding the next one would push the group's padded work, `G * Qmax * Kmax`, past
    `MAX_PADDING_FACTOR` times its real work. Each group lists its sequences in batch order.
    With `ragged_decode` the decode steps are one group: nothing pads them (a group per length
    band cost a kernel call, a gather of its query rows and a scatter of its output each).
    """

    def kind(i: int) -> int:
        if query_lens[i] == 1:
            return 0
        return 1 if context_lens[i] == query_lens[i] else 2

    groups: list[list[int]] = []
    for k in range(3):
        ids = [i for i in range(len(query_lens)) if kind(i) == k]
        if k == 0 and ragged_decode:
            groups += [ids] if ids else []
            continue
        ids.sort(key=lambda i: query_lens[i] * context_lens[i], reverse=True)
        current: list[int] = []
        q_max = k_max = work = 0
        for i in ids:
            q, k = query_lens[i], context_lens[i]
            new_q, new_k = max(q_max, q), max(k_max, k)
            padded = (len(current) + 1) * new_q * new_k
            if current and padded > MAX_PADDING_FACTOR * (work + q * k):
                groups.append(sorted(current))
                current, new_q, new_k, work = [], q, k, 0
            current.append(i)
            q_max, k_max, work = new_q, new_k, work + q * k
        if current:
            groups.append(sorted(current))
    return groups


def _group_tensors(
    seq_ids: list[int], seqs: _SeqTensors, block_size: int, fresh: bool
) -> tuple[tuple[int, int], dict[str, torch.Tensor]]:
    """(Qmax, Kmax) and the CPU index tensors of one attention group."""
    idx = torch.tensor(seq_ids, dtype=torch.long)
    g_qlen, g_computed, g_start = seqs.q_lens[idx], seqs.num_computed[idx], seqs.starts[idx]
    q_max = int(g_qlen.max())
    q_off = torch.arange(q_max)
    q_valid = q_off[None, :] < g_qlen[:, None]  # [G, Qmax]
    tensors = {
        # Padding queries pretend to sit at position 0 so their mask row is never empty (an
        # all-masked row makes SDPA produce NaN); their outputs are dropped.
        "query_pos": torch.where(q_valid, g_computed[:, None] + q_off[None, :], 0),
    }
    if fresh:
        kv_max = q_max
    else:
        num_blocks = cdiv(int((g_computed + g_qlen).max()), block_size)
        kv_max = num_blocks * block_size
        tensors["kv_blocks"] = seqs.tables[idx, :num_blocks].reshape(-1)
    tensors["kv_pos"] = torch.arange(kv_max)
    if q_max > 1:
        tensors.update(
            seq_starts=g_start,
            seq_qlens=g_qlen,
            seq_computed=g_computed,
            block_tables=seqs.tables[idx],
        )
    whole_decode_batch = q_max == 1 and len(seq_ids) == seqs.q_lens.numel()
    if not whole_decode_batch:
        rows = torch.where(q_valid, g_start[:, None] + q_off[None, :], 0).reshape(-1)
        valid = q_valid.reshape(-1).nonzero().squeeze(1)
        tensors.update(query_rows=rows, query_valid=valid, token_rows=rows[valid])
    return (q_max, kv_max), tensors


def _to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Move the step's index tensors (all int64) with ONE host-to-device copy."""
    if device.type == "cpu":
        return tensors
    names = list(tensors)
    flat = torch.cat([tensors[n].reshape(-1) for n in names]).to(device)
    parts = flat.split([tensors[n].numel() for n in names])
    return {n: part.view(tensors[n].shape) for n, part in zip(names, parts, strict=True)}
