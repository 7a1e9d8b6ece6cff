"""The cache-aware routing scorer: where would a prompt find the most of its prefix cached?

A node keeps the blocks it computed in its prefix cache, keyed by chained block hashes (block
i's hash covers the whole prompt up to the end of block i, so two prompts share a hash exactly
when they share that whole prefix). A router cannot see those caches, but it knows what it sent
where: `PrefixIndex` remembers, per node, the chains of the prompts sent there (an approximate,
LRU per node, bounded by that node's pool when it reports one, so that the node's own LRU
evictions are mirrored; the hits a node reports correct it). `prefill_cost` scores a node by the
prompt it would compute there, the uncached work already outstanding on it, and the prefix it
would duplicate by not going where that prefix is.

Two routers use it: the decode node choosing a prefill node (decode_node/kv_router.py, keyed on
token ids with the engine's block size) and the proxy choosing a decode replica
(pdserve/prefix_router.py, keyed on token ids or, having no tokenizer, on the prompt's text).
Pure: no I/O, no clock, no torch.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from shared.engine.resources.block_manager import BlockHash, compute_block_hashes

DEFAULT_INDEX_BLOCKS = 1 << 16  # blocks remembered per node whose own pool size is not known


def prompt_hashes(prompt: Sequence[int], block_size: int) -> list[BlockHash]:
    """The chain of the prompt's full blocks (what a node caches after computing it): the
    engine's own hashes, so a router with the engine's block size keys exactly as it does."""
    return compute_block_hashes(list(prompt), block_size)


def text_hashes(
    text: bytes, chunk_bytes: int, domain: bytes = b"text", max_chunks: int | None = None
) -> list[BlockHash]:
    """The chain of the full `chunk_bytes`-byte chunks of `text`, for a router without the
    model's tokenizer. Equal text tokenizes equally, so a shared text prefix predicts a shared
    token prefix (SGLang's cache-aware router matches on text the same way). `domain` keeps
    chains of different encodings (raw text, serialized chat) from ever meeting."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    n = len(text) // chunk_bytes
    if max_chunks is not None:
        n = min(n, max_chunks)
    parent = hashlib.sha256(domain).digest()[:16]
    out: list[BlockHash] = []
    for i in range(n):
        parent = hashlib.sha256(parent + text[i * chunk_bytes : (i + 1) * chunk_bytes]).digest()
        parent = parent[:16]
        out.append(parent)
    return out


def prefill_cost(
    prompt_len: int,
    cached_tokens: int,
    outstanding_tokens: int,
    best_cached_tokens: int = 0,
) -> float:
    """What sending a prompt to a node costs, in tokens of prefill work.

    The tokens it would compute there and the uncached tokens already waiting there (both are
    work ahead of its first token), plus the cached prefix it would duplicate: the best hit any
    node offers, minus this node's. That last term is why a cached prefix is left only for a
    node whose queue is shorter by more than the prefix itself: a diversion recomputes the
    prefix and keeps a second copy of it, which takes cache room every later prompt sharing it
    could have used (the imbalance threshold of SGLang's cache-aware router, in tokens)."""
    compute = max(0, prompt_len - cached_tokens)
    duplicated = max(0, best_cached_tokens - cached_tokens)
    return float(compute + max(0, outstanding_tokens) + duplicated)


class PrefixIndex:
    """Per node, the chains believed cached there, least recently used first."""

    def __init__(self, capacity: int = DEFAULT_INDEX_BLOCKS):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity  # per node, until `set_capacity` says what the node holds
        self._nodes: dict[str, OrderedDict[BlockHash, None]] = {}
        self._capacities: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(len(lru) for lru in self._nodes.values())

    def set_capacity(self, node: str, blocks: int) -> None:
        """`node` reported a pool of `blocks` blocks: its prefix cache holds no more."""
        if blocks >= 1:
            self._capacities[node] = blocks
            self._trim(node)

    def capacity_of(self, node: str) -> int:
        """Blocks remembered for `node` at most: what it reported holding, else the default."""
        return self._capacities.get(node, self.capacity)

    def matched_blocks(self, node: str, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of the chain believed cached on `node` (a chain: a miss ends it)."""
        lru = self._nodes.get(node)
        if lru is None:
            return 0
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def record(self, node: str, hashes: Sequence[BlockHash]) -> None:
        """`node` computed (or was sent) this chain: all of it is cached there now, most
        recently used. Tail first, as the node's block manager frees a request's blocks: its
        head, which more prompts share, is evicted last there and here."""
        lru = self._nodes.setdefault(node, OrderedDict())
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        self._trim(node)

    def correct(self, node: str, hashes: Sequence[BlockHash], reported_blocks: int) -> None:
        """`node` reported a hit of only `reported_blocks` leading blocks of this chain. If the
        next block was believed there, the node evicted it, and, its cache being LRU, every
        block it held for less long too: those entries go (the chain is recorded again once
        the node computes it)."""
        lru = self._nodes.get(node)
        if lru is None or reported_blocks >= len(hashes) or hashes[reported_blocks] not in lru:
            return
        evicted = hashes[reported_blocks]
        while lru:
            h, _ = lru.popitem(last=False)
            if h == evicted:
                break

    def forget_node(self, node: str) -> None:
        """A node restarted or was marked unhealthy: its cache is presumed gone."""
        self._nodes.pop(node, None)

    def nodes(self) -> set[str]:
        return {node for node, lru in self._nodes.items() if lru}

    def _trim(self, node: str) -> None:
        lru = self._nodes.get(node)
        limit = self.capacity_of(node)
        while lru is not None and len(lru) > limit:
            lru.popitem(last=False)
