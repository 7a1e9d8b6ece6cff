"""Decode node configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from decode_node.push_mode import PUSH_MODES
from shared.engine.config import EngineConfig
from shared.engine.connector.offload import OffloadStats
from shared.engine.connector.offload_config import OffloadConfig
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.scheduling.placement import PlacementPolicy
from shared.engine.scheduling.service_level import ServiceLevel
from shared.engine.scheduling.slo import SloPolicy
from shared.serving.limits import (
    DRAIN_GRACE_S,
    HEALTH_CHECK_INTERVAL_S,
    HTTP_BODY_TIMEOUT_S,
    HTTP_HEADER_TIMEOUT_S,
    HTTP_KEEP_ALIVE_S,
    HTTP_MAX_CONNECTIONS,
    KV_FENCE_TIMEOUT_S,
    KV_TRANSFER_TIMEOUT_S,
    PREFILL_TIMEOUT_S,
)
from shared.serving.tls import ClientTls, ServerTls
from transfer.protocol import resolve_bind_address

if TYPE_CHECKING:  # FastAPI and pydantic load with the node, not with every CLI command
    from shared.model.loader import LoadedModel
    from shared.serving.connection_limits import ConnectionLimits
    from shared.serving.http.service import HttpApiConfig
    from shared.serving.images.image_limits import ImageLimits


@dataclass(frozen=True)
class DecodeNodeConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    prefill_targets: tuple[str, ...] = ()  # host:port of every prefill node
    host: str = "127.0.0.1"
    port: int = 50051
    ucx_host: str = "127.0.0.1"  # the transfer plane's address, advertised to prefill nodes
    ucx_port: int = 0
    ucx_bind_host: str | None = None  # the KV listener binds here; None: ucx_host
    metrics_port: int = -1  # -1: no metrics endpoint, 0: an ephemeral port
    # the OpenAI-compatible HTTP API (and /metrics, /health, /version): -1 off, 0 ephemeral
    http_port: int = -1
    served_model_name: str = ""  # the `model` HTTP requests name; "": the model's own name
    api_key: str | None = None  # HTTP bearer token; None: no authentication
    chat_template: str | None = None  # a Jinja file overriding the model's own chat template
    # how "auto" tool choice reads calls out of the text (hermes, llama3_json); None: refused
    tool_call_parser: str | None = None
    max_request_bytes: int = 16 * 1024 * 1024  # HTTP request bodies over this get 413
    # hosts whose image URLs the node fetches (--allowed-media-domains); none: data URLs only
    allowed_media_domains: tuple[str, ...] = ()
    # stored Responses API answers (GET /v1/responses/{id}, previous_response_id): at most this
    # many MiB and entries in memory, least recently used evicted first (0: keep none)
    responses_store_mb: int = 64
    responses_store_entries: int = 10_000
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (shared/serving/http/lora_routes.py)
    allow_runtime_lora: bool = False
    # HTTP connections (shared/serving/connection_limits.py): a request's headers and body must
    # arrive within these seconds, an idle keep-alive connection closes after its timeout, and
    # past max_connections open connections a request gets 503
    http_header_timeout: float = HTTP_HEADER_TIMEOUT_S
    http_body_timeout: float = HTTP_BODY_TIMEOUT_S
    http_keep_alive_timeout: float = HTTP_KEEP_ALIVE_S
    http_max_connections: int = HTTP_MAX_CONNECTIONS
    max_inflight: int = 256  # requests past the admission queue at once (blocks reserved)
    # requests waiting, holding nothing, for blocks or an inflight slot; past it
    # RESOURCE_EXHAUSTED with a retry hint (0: refuse whatever cannot be admitted at once)
    max_queued: int = 1024
    # default SLO targets (ms) for requests that set none (shared/engine/scheduling/slo.py); None:
    # none
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None
    kv_transfer_timeout: float = (
        KV_TRANSFER_TIMEOUT_S  # from prefill dispatch to the last KV byte placed
    )
    # after a transfer ends, how long a payload write still posted into its blocks (sender
    # stalled mid-message) may hold them before every KV endpoint is force-closed to end it
    kv_fence_timeout: float = KV_FENCE_TIMEOUT_S
    prefill_timeout: float = (
        PREFILL_TIMEOUT_S  # the Prefill RPC, queueing on the prefill node included
    )
    prefill_retries: int = 1  # re-dispatches to another healthy prefill node after a failure
    health_check_interval: float = HEALTH_CHECK_INTERVAL_S
    # on SIGTERM: how long in-flight requests may finish before the rest are aborted (fit it in
    # the orchestrator's grace period, e.g. Kubernetes' terminationGracePeriodSeconds)
    drain_grace: float = DRAIN_GRACE_S
    # conditional prefill: a prompt leaving at most this many tokens to compute after this
    # node's prefix-cache hit is prefilled here when the step budget has room (0: never);
    # see docs/performance.md for the measurement behind the default
    local_prefill_tokens: int = 256
    # ... and while nothing decodes or waits here (no inter-token latency to protect), a prompt
    # leaving at most this many, chunked over several steps (0: only the rule above; a
    # local_prefill_tokens of 0 turns both off)
    local_prefill_idle_tokens: int = 2048
    local_prefill_fallback: bool = True  # no prefill node can serve: prefill here
    # how a prompt picks its prefill node: kv (fewest tokens to compute there, by the prefix
    # chains sent there, plus outstanding work), least-loaded or round-robin
    prefill_routing: str = "kv"
    # `pdserve colocated`: no prefill nodes, every prompt prefilled here (NODE_ROLE_COLOCATED)
    colocated: bool = False
    # how prefill nodes push the KV: layer by layer as it is computed, the whole request after
    # the last layer, or auto (whole from a prefill node on this host into a CPU pool, layer-wise
    # otherwise: decode_node/push_mode.py says why)
    push: str = "auto"
    # window-aware transfer: sliding-window layers are not sent the prompt blocks that fell out
    # of their window (shared/model/kv_window.py); needs prefill nodes that know the field
    window_aware_transfer: bool = False
    # KV tiers below the pool (--kv-offload-*: pdserve/cli/offload_args.py)
    kv_offload_cpu_gb: float = 0.0
    kv_offload_disk_dir: str = ""
    kv_offload_disk_gb: float = 0.0
    # what the tiers count (the engine thread writes, /metrics reads)
    offload_stats: OffloadStats = field(default_factory=OffloadStats, compare=False)
    tls: ServerTls | None = None  # the public endpoint; None: plaintext
    prefill_tls: ClientTls | None = None  # how to reach prefill nodes; None: plaintext

    def slo_policy(self) -> SloPolicy:
        """The admission's SLO defaults (shared/engine/scheduling/slo.py): off unless a target
        is set."""
        return SloPolicy(self.ttft_slo_ms, self.itl_slo_ms)

    def decode_settings(self, slo: SloPolicy) -> DecodeSettings:
        """The engine's decode role: where prompts are prefilled and how the queue admits."""
        # a colocated node's scheduler queue is its admission queue: bounded the same way
        bound = self.max_inflight + self.max_queued if self.colocated else None
        placement = PlacementPolicy(
            self.local_prefill_tokens, self.local_prefill_idle_tokens, max_local_requests=bound
        )
        return DecodeSettings(
            placement,
            self.max_queued,
            self.max_inflight,
            slo,
            offload=self.offload(),
            offload_stats=self.offload_stats,
        )

    def offload(self) -> OffloadConfig:
        return OffloadConfig.from_gb(
            self.kv_offload_cpu_gb,
            self.kv_offload_disk_dir,
            self.kv_offload_disk_gb,
            self.engine.model,
        )

    def http_api(self, loaded: LoadedModel) -> HttpApiConfig:
        """The HTTP API's settings; `--chat-template` is read here, at start."""
        from shared.serving.http.service import HttpApiConfig, load_chat_template

        template = None
        if self.chat_template is not None:
            template = load_chat_template(self.chat_template, loaded)
        return HttpApiConfig(
            served_model_name=self.served_model_name,
            api_key=self.api_key,
            chat_template=template,
            tool_call_parser=self.tool_call_parser,
            max_request_bytes=self.max_request_bytes,
            responses_store_bytes=self.responses_store_mb * 1024 * 1024,
            responses_store_entries=self.responses_store_entries,
            connection=self.http_connection,
            runtime_lora=self.allow_runtime_lora,
            image_limits=self.image_limits,
        )

    @property
    def image_limits(self) -> ImageLimits:
        """What one request's images may be (both APIs)."""
        from shared.serving.images.image_limits import ImageLimits

        domains = frozenset(host.lower() for host in self.allowed_media_domains)
        return ImageLimits(allowed_domains=domains)

    @property
    def http_connection(self) -> ConnectionLimits:
        from shared.serving.connection_limits import ConnectionLimits

        return ConnectionLimits(
            header_timeout=self.http_header_timeout,
            body_timeout=self.http_body_timeout,
            keep_alive_timeout=self.http_keep_alive_timeout,
            max_connections=self.http_max_connections,
        )

    @property
    def kv_bind_host(self) -> str:
        return self.ucx_host if self.ucx_bind_host is None else self.ucx_bind_host

    def validate(self) -> None:
        self.engine.validate()
        self.offload()
        if self.push not in PUSH_MODES:
            raise ValueError(f"--push must be one of {', '.join(PUSH_MODES)}, got {self.push!r}")
        if self.colocated and self.prefill_targets:
            raise ValueError("a colocated node takes no prefill targets (--prefill)")
        if not self.prefill_targets and not self.colocated:
            raise ValueError(
                "a decode node needs at least one prefill target (--prefill HOST:PORT)"
            )
        for target in self.prefill_targets:
            host, sep, port = target.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"prefill target {target!r} is not HOST:PORT")
        for name in ("port", "ucx_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        try:
            resolve_bind_address(self.kv_bind_host)
        except ValueError as e:
            raise ValueError(f"--ucx-bind / --ucx-host: {e}") from None
        for name in ("metrics_port", "http_port"):
            value = getattr(self, name)
            if not -1 <= value <= 65535:
                raise ValueError(f"{name} must be -1 (off) or a port, got {value}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        for name in ("responses_store_mb", "responses_store_entries"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: keep none), got {getattr(self, name)}")
        self.http_connection.validate()
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"--chat-template {self.chat_template!r} is not a readable file")
        self._validate_tool_call_parser()
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        for name in (
            "kv_transfer_timeout",
            "kv_fence_timeout",
            "prefill_timeout",
            "health_check_interval",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for tls in (self.tls, self.prefill_tls):
            if tls is not None:
                tls.validate()
        if not 0 <= self.drain_grace <= 3600:
            raise ValueError(f"--drain-grace must be in [0, 3600] seconds, got {self.drain_grace}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        ServiceLevel(ttft_slo_ms=self.ttft_slo_ms, itl_slo_ms=self.itl_slo_ms).validate()
        self._validate_placement()

    def _validate_tool_call_parser(self) -> None:
        from shared.serving.http.tool_parsers import TOOL_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )

    def _validate_placement(self) -> None:
        """Where a prompt is prefilled: here (the local rules) or on which prefill node."""
        from decode_node.kv_router import ROUTING_MODES

        if self.prefill_routing not in ROUTING_MODES:
            raise ValueError(
                f"prefill_routing must be one of {', '.join(ROUTING_MODES)}, "
                f"got {self.prefill_routing!r}"
            )
        for name in ("local_prefill_tokens", "local_prefill_idle_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        if self.prefill_retries < 0:
            raise ValueError(f"prefill_retries must be >= 0, got {self.prefill_retries}")
