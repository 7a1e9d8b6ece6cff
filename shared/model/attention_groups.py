"""How a step's sequences share attention calls: `split_groups` partitions them into a few
padded groups (decode steps, fresh prefills and continued prefill chunks apart, very different
lengths apart, so padding stays bounded), and an `AttentionGroup` holds one group's index
tensors, which each layer's attention call reads (shared/model/attention.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from shared.cdiv import cdiv


class SeqIndex(Protocol):
    """The per-sequence CPU tensors a group's indices derive from (ForwardBatch's)."""

    q_lens: torch.Tensor  # [B]
    num_computed: torch.Tensor  # [B]
    starts: torch.Tensor  # [B] row of each sequence's first new token in [T]
    tables: torch.Tensor  # [B, max_blocks_in_use], padded with each row's first block


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


# A group may spend at most this multiple of its real attention work on padding before the next
# (shorter) sequence starts a new group. Measured on CPU, decode batch of 32 with contexts spread
# over 16..576: for a 4-layer, 8-head model 1.3 ran 18% faster than one padded group (2.0) and
# beat 1.1 / 1.2 / 1.5; for the 4-head `tiny` model it cost 4% (per-call overhead weighs more
# when heads are few). Uniform batches are one group either way.
MAX_PADDING_FACTOR = 1.3


def split_groups(
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


def group_tensors(
    seq_ids: list[int], seqs: SeqIndex, block_size: int, fresh: bool
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
