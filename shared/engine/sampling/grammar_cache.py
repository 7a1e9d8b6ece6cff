"""Compiled grammars held by a node, bounded in bytes: an LRU by spec, plus the grammars requests
still hold after the LRU dropped them (a request keeps its grammar on its StructuredOutput until
it is gone). Both count against one budget, measured as xgrammar reports each grammar's size
(`CompiledGrammar.memory_size_bytes`: its token-mask cache, which dominates; a 270 KB enum schema
compiles to 65 MB on SmolLM2's vocabulary). A grammar that does not fit beside those in use is
refused (GrammarBusy) rather than held past the budget.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

from shared.engine.sampling.structured_output import StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

# Default budget of one node's compiled grammars: a decode pod is given 2 GiB in all
CACHE_BYTES = 128 * 1024 * 1024


class HeldGrammar:
    """One compiled grammar and its size; the budget counts it until the last reference goes."""

    __slots__ = ("__weakref__", "grammar", "nbytes")

    def __init__(self, grammar: xgr.CompiledGrammar, nbytes: int):
        self.grammar = grammar
        self.nbytes = nbytes


class GrammarCache:
    def __init__(self, budget_bytes: int = CACHE_BYTES):
        self.budget_bytes = budget_bytes
        self._lru: OrderedDict[StructuredOutput, HeldGrammar] = OrderedDict()
        # reentrant: dropping the last reference to a grammar (inside an eviction, under the
        # lock) runs its finalizer, which takes the lock again
        self._lock = threading.RLock()
        self._held_bytes = 0  # every live HeldGrammar's, cached or not

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(h.nbytes for h in self._lru.values())

    def get(self, spec: StructuredOutput) -> HeldGrammar | None:
        with self._lock:
            hit = self._lru.get(spec)
            if hit is not None:
                self._lru.move_to_end(spec)
            return hit

    def fits(self, nbytes: int) -> bool:
        """Whether a grammar of `nbytes` fits the budget once the LRU drops what it must (the
        least recent first); those in use elsewhere still count until they are released."""
        with self._lock:
            self._evict_until(self.budget_bytes - nbytes)
            return self._held_bytes + nbytes <= self.budget_bytes

    def put(self, spec: StructuredOutput, grammar: xgr.CompiledGrammar) -> HeldGrammar:
        """Hold `grammar` (its size counted from now until its last reference goes) and cache
        it, dropping the least recent to stay within the budget where they can go."""
        held = HeldGrammar(grammar, int(grammar.memory_size_bytes))
        with self._lock:
            self._held_bytes += held.nbytes
            weakref.finalize(held, self._release, held.nbytes)
            self._lru[spec] = held
            self._lru.move_to_end(spec)
            self._evict_until(self.budget_bytes, keep=spec)
        return held

    def _evict_until(self, limit: int, keep: StructuredOutput | None = None) -> None:
        for spec in list(self._lru):
            if self._held_bytes <= limit:
                return
            if spec != keep:
                del self._lru[spec]  # frees its bytes now unless a request still holds it

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._held_bytes -= nbytes
