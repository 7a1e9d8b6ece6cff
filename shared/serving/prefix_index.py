"""The cache-aware routing scorer: where would a prompt find the most of its prefix cached?

A node keeps the blocks it computed in its prefix cache, keyed by chained block hashes (block
i's hash covers the whole prompt up to the end of block i, so two prompts share a hash exactly
when they share that whole prefix). A router cannot see those caches, but it knows what it sent
where: `PrefixIndex` remembers, per node, the chains of the prompts sent there (an approximate,
bounded LRU: the node may have evicted some). `prefill_cost` scores a node by the prompt it
would compute there plus the prompt work already outstanding on it.

Two routers use it: the decode node choosing a prefill node (decode_node/kv_router.py, keyed on
token ids with the engine's block size) and the proxy choosing a decode replica
(pdserve/prefix_router.py, keyed on token ids or, having no tokenizer, on the prompt's text).
Pure: no I/O, no clock, no torch.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from shared.engine.block_manager import BlockHash, compute_block_hashes

DEFAULT_INDEX_BLOCKS = 1 << 16  # (node, block) entries remembered, all nodes together


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


def prefill_cost(prompt_len: int, cached_tokens: int, outstanding_tokens: int) -> float:
    """Tokens a node would compute for this prompt, plus the prompt tokens already waiting
    there: both are prefill work ahead of this prompt's first token."""
    return float(max(0, prompt_len - cached_tokens) + max(0, outstanding_tokens))


class PrefixIndex:
    def __init__(self, capacity: int = DEFAULT_INDEX_BLOCKS):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[tuple[str, BlockHash], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def matched_blocks(self, node: str, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of the chain believed cached on `node` (a chain: a miss ends it)."""
        n = 0
        for h in hashes:
            if (node, h) not in self._lru:
                break
            n += 1
        return n

    def record(self, node: str, hashes: Sequence[BlockHash]) -> None:
        """`node` prefilled this chain: all of it is cached there now, most recently used.
        Entries it did not report as hits were stale (evicted there); they are refreshed."""
        for h in hashes:
            key = (node, h)
            self._lru[key] = None
            self._lru.move_to_end(key)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def forget_node(self, node: str) -> None:
        """A node restarted or was marked unhealthy: its cache is presumed gone."""
        for key in [k for k in self._lru if k[0] == node]:
            del self._lru[key]

    def nodes(self) -> set[str]:
        return {node for node, _ in self._lru}
