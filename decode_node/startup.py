"""The decode node's parts, built at start-up: the KV receiver, the prefill pool and the
metrics a decode node exports beyond every node's own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter

from decode_node.config import DecodeNodeConfig
from decode_node.peers import PrefillPeer, prefill_pool
from shared.engine.info import EngineInfo
from shared.engine.thread import EngineSnapshot
from shared.model import attention_timing, native
from shared.serving.grpc_server import NodeMetrics, new_instance_id
from shared.serving.metrics import (
    prompt_tokens_counter,
    register_scrape_counter,
    register_scrape_gauge,
)
from shared.serving.offload_metrics import register_offload_metrics
from shared.serving.replica_pool import ReplicaPool
from transfer.ucx import KvReceiver


@dataclass
class PrefillCounters:
    prefills: Counter  # pdserve_prefills_total{where="local|remote"}
    prompt_tokens: Counter  # pdserve_prompt_tokens_total{source="computed|cached"}

    def local(self, prompt_len: int, cached: int) -> None:
        """A prompt prefilled here: what this engine computed and what its cache gave."""
        self.prefills.labels(where="local").inc()
        self.prompt_tokens.labels(source="computed").inc(prompt_len - cached)
        self.prompt_tokens.labels(source="cached").inc(cached)

    def remote(self) -> None:
        self.prefills.labels(where="remote").inc()


@dataclass
class DecodeParts:
    receiver: KvReceiver
    pool: ReplicaPool[PrefillPeer]
    metrics: NodeMetrics
    counters: PrefillCounters


def build_parts(
    config: DecodeNodeConfig, info: EngineInfo, snapshot: Callable[[], EngineSnapshot]
) -> DecodeParts:
    native.log_states()  # each C kernel on (variant, path) or off and why, once at start-up
    # attention's path for each kind, timed on this CPU at the first start, then cached
    attention_timing.establish(info.loaded.config, info.kv_pool.dtype, info.device_type)
    receiver = KvReceiver(
        info.kv_pool,
        info.layout,
        config.ucx_host,
        config.ucx_port,
        bind_host=config.kv_bind_host,
        instance_id=new_instance_id(),
    )

    def new_prefill_instance(peer: PrefillPeer, old: int) -> None:
        why = f"prefill node {peer.target} restarted (instance {old:#x} is gone)"
        receiver.sender_restarted(old, why)

    pool = prefill_pool(
        config.prefill_targets,
        config.health_check_interval,
        None if config.prefill_tls is None else config.prefill_tls.credentials(),
        new_prefill_instance,
    )
    metrics = NodeMetrics(snapshot, rejected=lambda: receiver.rejected_total)
    register_decode_metrics(metrics, receiver, pool)
    if config.kv_offload_cpu_gb:
        register_offload_metrics(metrics.registry, config.offload_stats)
    registry = metrics.registry
    counters = PrefillCounters(
        Counter(
            "pdserve_prefills",
            "Prompts prefilled, by where: this node's engine (local) or a prefill node",
            ["where"],
            registry=registry,
        ),
        prompt_tokens_counter(registry),
    )
    for where in ("local", "remote"):
        counters.prefills.labels(where=where)
    return DecodeParts(receiver, pool, metrics, counters)


def register_decode_metrics(
    metrics: NodeMetrics, receiver: KvReceiver, pool: ReplicaPool[PrefillPeer]
) -> None:
    registry = metrics.registry
    register_scrape_gauge(
        registry,
        "pdserve_prefill_peer_healthy",
        "1 while a prefill node is routed to, 0 while it is skipped as unhealthy",
        lambda: {(p.target,): float(p.healthy) for p in pool.replicas},
        labelnames=("peer",),
    )
    register_scrape_gauge(
        registry,
        "pdserve_prefill_peer_instance",
        "1 for the process instance (ModelInfo.instance_id, hex) each prefill node answers as",
        lambda: {(p.target, f"{p.instance_id:#x}"): 1.0 for p in pool.replicas if p.instance_id},
        labelnames=("peer", "instance"),
    )
    register_scrape_counter(
        registry,
        "pdserve_prefill_peer_restarts_total",
        "New process instances seen at prefill nodes' addresses: what was learnt from each old "
        "one dropped, the transfers granted to it failed",
        lambda: float(sum(p.restarts for p in pool.replicas)),
    )
    register_scrape_counter(
        registry,
        "pdserve_kv_transfers_sender_restarted_total",
        "KV transfers failed because the prefill instance they were granted to was replaced",
        lambda: float(receiver.senders_restarted),
    )
    register_scrape_gauge(
        registry,
        "pdserve_kv_writes_in_flight",
        "KV payload receives posted into the pool and not completed",
        lambda: float(receiver.writes_in_flight),
    )
    register_scrape_gauge(
        registry,
        "pdserve_kv_fenced_transfers",
        "ended transfers whose blocks a posted payload receive may still write",
        lambda: float(receiver.fenced_transfers),
    )
    register_scrape_counter(
        registry,
        "pdserve_kv_endpoint_resets_total",
        "KV endpoints force-closed to end a receive whose sender stalled mid-payload",
        lambda: float(receiver.endpoint_resets),
    )
    register_scrape_counter(
        registry,
        "pdserve_kv_listener_restarts_total",
        "KV listener restarts: its shared-memory receive queue stuck after a peer died mid-message",
        lambda: float(receiver.listener_restarts),
    )
