"""How many times `pdserve up` has restarted a node: handed to the node in its environment, and
exported on the node's own /metrics, the one place a scraper already looks (`up` itself serves
no metrics, and a node cannot see its siblings' restarts)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter

ENV = "PDSERVE_RESTARTS"


def restart_env(base: Mapping[str, str], restarts: int) -> dict[str, str]:
    """`base` plus the restart count of the node about to start (0: its first start)."""
    return {**base, ENV: str(restarts)}


def export_restarts(registry: CollectorRegistry) -> None:
    """`pdserve_node_restarts_total`: the restarts before this process, as its supervisor
    counted them. A per-process counter that starts where the last one stopped, so `increase()`
    over a window shows the restarts in it."""
    value = os.environ.pop(ENV, "0")  # not for this node's own children
    counter = Counter(
        "pdserve_node_restarts",
        "Times `pdserve up` restarted this node after it exited unexpectedly",
        registry=registry,
    )
    counter.inc(int(value) if value.isdigit() else 0)
