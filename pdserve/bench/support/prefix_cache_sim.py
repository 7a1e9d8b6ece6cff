"""The prefix-hit rate one shared cache would reach: the yardstick of KV-aware routing.

Replays prompts in arrival order through a single prefix cache of `capacity_blocks` blocks that
works like a prefill node's (shared/engine/resources/block_manager.py): full blocks keyed by their
chained
hashes; a prompt reuses its longest run of cached leading blocks, never its last token (that one
is always computed, for its logits); after the prefill all its full blocks are cached, the
blocks released tail first so that a prompt's prefix is evicted last; least recently used
blocks are evicted past the capacity. Each prompt is assumed finished before the next one
arrives (no blocks held by running requests), which is the ideal the routed cluster is measured
against. Pure: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.engine.resources.block_manager import BlockHash, compute_block_hashes


@dataclass(frozen=True)
class CacheReplay:
    cached_tokens: int
    computed_tokens: int

    @property
    def hit_rate(self) -> float:
        total = self.cached_tokens + self.computed_tokens
        return self.cached_tokens / total if total else 0.0


def replay_shared_cache(
    prompts: Iterable[Sequence[int]], block_size: int, capacity_blocks: int
) -> CacheReplay:
    """Prompt tokens cached vs computed by one LRU prefix cache over `prompts` in order."""
    if block_size < 1 or capacity_blocks < 0:
        raise ValueError(f"block_size {block_size} must be >= 1, capacity {capacity_blocks} >= 0")
    lru: OrderedDict[BlockHash, None] = OrderedDict()  # first: least recently used
    cached = computed = 0
    for prompt in prompts:
        hashes = compute_block_hashes(list(prompt), block_size)
        usable = (len(prompt) - 1) // block_size  # the last token is always computed
        hit = 0
        for h in hashes[:usable]:
            if h not in lru:
                break
            hit += 1
        cached += hit * block_size
        computed += len(prompt) - hit * block_size
        for h in reversed(hashes):  # released tail first: the first block is the most recent
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return CacheReplay(cached, computed)
