"""KV-aware prefill routing: send a prompt where the fewest of its tokens must be computed.

A prefill node keeps the blocks it computed in its prefix cache, keyed by the chained block
hashes of shared/engine/block_manager.py. This decode node cannot see those caches, but it knows
what it sent where: `PrefixIndex` remembers, per prefill node, the block-hash chains of the
prompts it sent there (an approximate, bounded LRU: the node may have evicted some), and each
`Prefill` response's `cached_tokens` corrects it (the blocks past the reported hit are not
there). `prefill_cost` scores a node by the tokens it would compute plus its outstanding work.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from shared.engine.block_manager import BlockHash, compute_block_hashes

ROUTING_MODES = ("kv", "least-loaded", "round-robin")
DEFAULT_INDEX_BLOCKS = 1 << 16  # (node, block) entries remembered, all nodes together


def prompt_hashes(prompt: Sequence[int], block_size: int) -> list[BlockHash]:
    """The chain of the prompt's full blocks (what a prefill node caches after computing it)."""
    return compute_block_hashes(list(prompt), block_size)


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
