"""Every bound pdserve puts on what crosses its public surfaces, and its serving timeouts.

One place to read and change them; the "Bounds" table of docs/api.md lists the same values. The
sampling bounds that the colocated engine enforces too (stop strings, minimum temperature) live
with SamplingParams, since shared/engine may not import serving code; they are re-exported here.
"""

from __future__ import annotations

from shared.engine.sampling.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MIN_TEMPERATURE,
)

__all__ = [
    "DRAIN_GRACE_S",
    "GRPC_CHANNEL_OPTIONS",
    "HEALTH_CHECK_INTERVAL_S",
    "HTTP_BODY_TIMEOUT_S",
    "HTTP_HEADER_TIMEOUT_S",
    "HTTP_KEEP_ALIVE_S",
    "HTTP_MAX_CONNECTIONS",
    "KV_FENCE_TIMEOUT_S",
    "KV_TRANSFER_TIMEOUT_S",
    "MAX_MESSAGE_BYTES",
    "MAX_REQUEST_ID_CHARS",
    "MAX_SEED",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MIN_TEMPERATURE",
    "ORPHAN_DRAIN_GRACE_S",
    "PREFILL_DEFAULT_DEADLINE_S",
    "PREFILL_TIMEOUT_S",
    "PUSH_QUIESCE_S",
]

# gRPC messages, both directions, on every server and channel (client, node-to-node, proxy).
# Prompts travel as token lists or text: 64 MiB leaves room for very long contexts without
# letting one runaway message exhaust memory.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

GRPC_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# A caller-chosen request id is echoed in every streamed message, in logs and metrics: short,
# printable ASCII only (no control characters that could forge log lines).
MAX_REQUEST_ID_CHARS = 128

# The seed is a uint64 on the wire; JSON (HTTP) has no such type, so it is checked.
MAX_SEED = 2**64 - 1

# Seconds a node gives in-flight RPCs to finish when told to stop (SIGTERM / SIGINT) ...
DRAIN_GRACE_S = 5.0
# ... and when its parent died (lifeline closed): nobody is waiting for it, and it must be gone
# within 2 s so that a killed `pdserve up` frees its ports at once.
ORPHAN_DRAIN_GRACE_S = 0.5

# Default timeouts of the nodes (DecodeNodeConfig, PrefillNodeConfig, the CLI's flags), seconds.
KV_TRANSFER_TIMEOUT_S = 30.0  # decode: from prefill dispatch to the last KV byte placed
KV_FENCE_TIMEOUT_S = 5.0  # decode: a posted payload write may hold ended blocks this long
PREFILL_TIMEOUT_S = 60.0  # decode: the Prefill RPC, queueing on the prefill node included
HEALTH_CHECK_INTERVAL_S = 2.0  # decode: between health checks of each prefill node
PREFILL_DEFAULT_DEADLINE_S = 120.0  # prefill: a Prefill call that carries no deadline
PUSH_QUIESCE_S = 5.0  # prefill: a finished push waits this long for UCX to stop reading blocks

# Every HTTP listener (the OpenAI API, /metrics, the proxy's front door), per connection: a
# request's headers must all arrive within HTTP_HEADER_TIMEOUT_S of its first byte (or of the
# connection's opening), its body within HTTP_BODY_TIMEOUT_S of its headers (16 MiB, the largest
# body allowed, in 30 s is ~0.5 MiB/s); an idle keep-alive connection is closed after
# HTTP_KEEP_ALIVE_S; past HTTP_MAX_CONNECTIONS open connections a request is refused with 503.
HTTP_HEADER_TIMEOUT_S = 5.0
HTTP_BODY_TIMEOUT_S = 30.0
HTTP_KEEP_ALIVE_S = 5.0
HTTP_MAX_CONNECTIONS = 1024
