"""KV-aware prefill routing: send a prompt where the fewest of its tokens must be computed.

A prefill node keeps the blocks it computed in its prefix cache, keyed by the chained block
hashes of shared/engine/resources/block_manager.py. This decode node cannot see those caches, but
it knows
what it sent where: a `PrefixIndex` remembers, per prefill node, the block-hash chains of the
prompts it sent there (an LRU per node, bounded by the pool size the node reports, so that its
evictions are mirrored), and each `Prefill` response's `cached_tokens` corrects it (a block
believed there past the reported hit was evicted, and everything older with it). `prefill_cost`
scores a node by the tokens it would compute, the uncached tokens outstanding there, and the
cached prefix it would duplicate elsewhere.
The scorer and the index are shared with the proxy's replica routing
(shared/serving/prefix_index.py); this module names the decode node's routing modes.
"""

from __future__ import annotations

from shared.serving.prefix_index import (
    DEFAULT_INDEX_BLOCKS,
    PrefixIndex,
    prefill_cost,
    prompt_hashes,
)

ROUTING_MODES = ("kv", "least-loaded", "round-robin")

__all__ = ["DEFAULT_INDEX_BLOCKS", "ROUTING_MODES", "PrefixIndex", "prefill_cost", "prompt_hashes"]
