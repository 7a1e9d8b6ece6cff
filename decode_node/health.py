"""Whether a decode node can serve every request now, and why: the HTTP /health answer.

Healthy means every request it admits can be prefilled somewhere: on a healthy prefill node, or
here when none is and the local fallback is on (`--local-prefill-fallback`, the default; a
colocated node always prefills here). A node whose prefill nodes are all down and whose fallback
is off answers every request UNAVAILABLE, so /health says 503 and a load balancer sends the
traffic elsewhere; with the fallback on it still answers them all (slower), so taking it out of
rotation would only shed capacity.
"""

from __future__ import annotations

from decode_node.config import DecodeNodeConfig
from decode_node.peers import PrefillPeer
from shared.serving.replica_pool import ReplicaPool


def decode_health(
    accepting: bool,
    config: DecodeNodeConfig,
    pool: ReplicaPool[PrefillPeer],
    crashed: BaseException | None = None,
) -> tuple[bool, str]:
    if crashed is not None:
        return False, f"down: its engine stopped ({crashed!r})"
    if not accepting:
        return False, "shutting down"
    if config.colocated:
        return True, "colocated: every prompt is prefilled here"
    total = len(pool.replicas)
    healthy = sum(1 for peer in pool.replicas if peer.healthy)
    if healthy:
        return True, f"{healthy} of {total} prefill nodes healthy"
    if config.local_prefill_fallback:
        return True, (
            f"no prefill node is healthy (0 of {total}); every prompt is prefilled here "
            "(--local-prefill-fallback)"
        )
    return False, (
        f"no prefill node is healthy (0 of {total}) and --no-local-prefill-fallback: "
        "no prompt can be prefilled"
    )
