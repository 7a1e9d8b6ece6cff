"""The proxy's choice of decode replica per call: `--routing kv` (default) or `least-loaded`.

A decode replica keeps the prompts it served in its prefix cache (it prefills short ones itself
and holds the KV of the rest), so a prompt that shares a prefix with one sent earlier is cheaper
where that one went. kv routing scores each healthy replica with the decode node's own scorer
(shared/serving/prefix_index.py): the prompt units not found in what this proxy sent there
(`PrefixIndex`, bounded LRU) plus the prompt units of the calls still in flight there, plus the
cached prefix it would duplicate (the best hit of any replica minus this one's: a prefix is left
only for a replica less busy by more than the prefix), and picks the cheapest (ties rotate).
The chain is recorded for the chosen replica when the call is sent (the replica caches it once
it prefills); a replica marked unhealthy or gone from DNS is forgotten (it may come back
restarted, its cache empty). Calls with no prompt key (other
methods, malformed bodies) and every call under `least-loaded` go to the replica with the fewest
calls in flight, as before.

`route` and `release` own a call's accounting on its replica: its `load` (calls in flight) and
its outstanding prompt units. /metrics: `pdserve_proxy_routed_total{backend,reason}` (reason
"prefix": sent where part of its prefix was predicted cached; "load": by load alone) and
`pdserve_proxy_prompt_units_total{predicted="cached|uncached"}`, the predicted prefix-hit rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter

from pdserve.prompt_key import TOKEN_BLOCK, PromptKey
from shared.serving.metrics import register_scrape_gauge
from shared.serving.prefix_index import DEFAULT_INDEX_BLOCKS, PrefixIndex, prefill_cost
from shared.serving.replica_pool import Replica, ReplicaPool

ROUTING_MODES = ("kv", "least-loaded")
R = TypeVar("R", bound=Replica)


class PrefixRouter:
    def __init__(
        self,
        mode: str,
        registry: CollectorRegistry,
        capacity: int = DEFAULT_INDEX_BLOCKS,
    ):
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, got {mode!r}")
        self.mode = mode
        self.index = PrefixIndex(capacity)
        self.outstanding: dict[str, int] = {}  # prompt units of the calls in flight, per backend
        self.routed = Counter(
            "pdserve_proxy_routed",
            "Calls sent to a backend, by why it was chosen: prefix (part of the prompt's prefix "
            "predicted cached there) or load",
            labelnames=("backend", "reason"),
            registry=registry,
        )
        self.units = Counter(
            "pdserve_proxy_prompt_units",
            "Prompt units (~tokens) routed, by whether the chosen backend was predicted to hold "
            "them in its prefix cache",
            labelnames=("predicted",),
            registry=registry,
        )
        for predicted in ("cached", "uncached"):
            self.units.labels(predicted)
        register_scrape_gauge(
            registry,
            "pdserve_proxy_prefix_index_blocks",
            "(backend, block) entries in the proxy's prefix index",
            lambda: float(len(self.index)),
        )

    @property
    def uses_keys(self) -> bool:
        """Whether calls need their prompt key (kv routing) or only the load."""
        return self.mode == "kv"

    def matched_units(self, backend: str, key: PromptKey) -> int:
        return self.index.matched_blocks(backend, key.hashes) * TOKEN_BLOCK

    def cost(self, key: PromptKey, candidates: list[Replica]) -> Callable[[Replica], float]:
        hits = {b.target: self.matched_units(b.target, key) for b in candidates}
        best = max(hits.values(), default=0)

        def kv(backend: Replica) -> float:
            cached = hits.get(backend.target, 0)
            return prefill_cost(key.units, cached, self.outstanding.get(backend.target, 0), best)

        return kv

    def route(self, pool: ReplicaPool[R], key: PromptKey | None, tried: set[str]) -> R | None:
        """The backend for this call's next attempt (None: no candidate left), its accounting
        taken: every route is followed by one `release`."""
        keyed = key is not None and self.uses_keys
        candidates = [r for r in pool.replicas if r.healthy and r.target not in tried]
        cost = self.cost(key, candidates) if keyed else None  # type: ignore[arg-type]
        backend = pool.pick(tried, cost)
        if backend is None:
            return None
        backend.load += 1
        if not keyed:
            self.routed.labels(backend.target, "load").inc()
            return backend
        assert key is not None
        cached = min(key.units, self.matched_units(backend.target, key))
        self.routed.labels(backend.target, "prefix" if cached else "load").inc()
        self.units.labels("cached").inc(cached)
        self.units.labels("uncached").inc(key.units - cached)
        self.index.record(backend.target, key.hashes)
        self.outstanding[backend.target] = self.outstanding.get(backend.target, 0) + key.units
        return backend

    def release(self, backend: Replica, key: PromptKey | None) -> None:
        """The call routed to `backend` ended (answered, failed or cancelled)."""
        backend.load -= 1
        if key is None or not self.uses_keys:
            return
        left = self.outstanding.get(backend.target, 0) - key.units
        if left > 0:
            self.outstanding[backend.target] = left
        else:
            self.outstanding.pop(backend.target, None)

    def forget(self, backend: str) -> None:
        """`backend` went unhealthy or left: what it cached is presumed gone."""
        self.index.forget_node(backend)
