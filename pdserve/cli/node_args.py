"""The flags of the node commands: `pdserve prefill`, `decode` and `colocated`.
`sub` is the parser's subparsers action."""

from __future__ import annotations

import argparse

from decode_node.push_mode import PUSH_MODES
from pdserve.cli.engine_args import engine_args
from pdserve.cli.http_args import http_args
from pdserve.cli.tls_args import client_tls_args, server_tls_args
from shared.serving import limits


def add_prefill(sub: argparse._SubParsersAction) -> None:
    pf = sub.add_parser("prefill", help="run one prefill node")
    engine_args(pf)
    pf.add_argument("--host", default="127.0.0.1")
    pf.add_argument("--port", type=int, default=50061)
    pf.add_argument("--metrics-port", type=int, default=0, help="-1 disables /metrics")
    pf.add_argument(
        "--encoder",
        default="",
        help="HOST:PORT[,HOST:PORT...] of encoder nodes (pdserve encode) for a vision model's "
        "images; without one (or when it fails) images are encoded here",
    )
    pf.add_argument(
        "--encoder-landing-mb",
        type=int,
        default=64,
        help="with --encoder: the memory encoder nodes push embeddings into over UCX (a call "
        "that does not fit gets them in its answer)",
    )
    _ucx_args(pf, "with --encoder: this node's embedding landing address, given to encoder nodes")
    _drain_arg(pf)
    server_tls_args(pf)
    client_tls_args(pf, "encoder-", "CA that signed the encoder nodes' certs (TLS to them)")


def add_decode(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    dc = sub.add_parser("decode", help="run one decode node (the public front door)")
    engine_args(dc)
    dc.add_argument("--prefill", required=True, help="HOST:PORT[,HOST:PORT...] of prefill nodes")
    dc.add_argument("--host", default="127.0.0.1")
    dc.add_argument("--port", type=int, default=50051)
    _ucx_args(dc, "this node's KV transfer address, given to prefill nodes")
    dc.add_argument("--metrics-port", type=int, default=0, help="-1 disables /metrics")
    _drain_arg(dc)
    http_args(dc)
    _decode_limit_args(dc)
    dc.add_argument(
        "--push",
        choices=PUSH_MODES,
        default=None,
        help="how prefill nodes push the KV: layerwise (each layer as it is computed), whole "
        "(after the last layer), auto (default: whole from a prefill node on this host into a "
        "CPU pool, layer-wise otherwise)",
    )
    dc.add_argument(
        "--whole-request-push", action="store_true", help="the same as --push whole (older flag)"
    )
    dc.add_argument(
        "--window-aware-transfer",
        action="store_true",
        help="sliding-window layers are not pushed the prompt blocks out of their window "
        "(Gemma 2/3, Phi-3, windowed Qwen/Mistral: fewer KV bytes for long prompts)",
    )
    _local_prefill_args(dc)
    server_tls_args(dc)
    client_tls_args(dc, "prefill-", "CA that signed the prefill nodes' certs")
    return dc


def add_colocated(sub: argparse._SubParsersAction, dc: argparse.ArgumentParser) -> None:
    """A decode node with no prefill nodes that prefills every prompt itself: the same flags."""
    co = sub.add_parser(
        "colocated",
        parents=[dc],
        add_help=False,
        conflict_handler="resolve",
        help="run one colocated node (prefill and decode in one engine)",
    )
    co.add_argument("--prefill", default="", help=argparse.SUPPRESS)


def _drain_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drain-grace",
        type=float,
        default=limits.DRAIN_GRACE_S,
        help="seconds in-flight requests may take to finish after SIGTERM before the rest are "
        f"aborted (default {limits.DRAIN_GRACE_S:g}; fit it in the orchestrator's grace period)",
    )


def _local_prefill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=256,
        help="prefill here a prompt with at most this many uncached tokens, in one step beside "
        "the decodes (0: never prefill here)",
    )
    p.add_argument(
        "--local-prefill-idle-tokens",
        type=int,
        default=2048,
        help="... and, while nothing decodes here, one with at most this many (0: off)",
    )
    p.add_argument(
        "--prefill-routing",
        choices=["kv", "least-loaded", "round-robin"],
        default="kv",
        help="kv: the prefill node with the fewest prompt tokens to compute plus outstanding work",
    )
    p.add_argument(
        "--local-prefill-fallback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="when no prefill node is healthy, prefill here instead of UNAVAILABLE",
    )


def _ucx_args(p: argparse.ArgumentParser, what: str) -> None:
    """The UCX listener a node lands pushes on: `what` says whose pushes and who is told."""
    p.add_argument("--ucx-host", default="127.0.0.1", help=f"{what} (and bound, see --ucx-bind)")
    p.add_argument("--ucx-port", type=int, default=0, help="UCX listener port (0: ephemeral)")
    p.add_argument(
        "--ucx-bind",
        default=None,
        metavar="ADDR",
        help="address the UCX listener binds (default: --ucx-host; 0.0.0.0 for every interface)",
    )


def _decode_limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-transfer-timeout", type=float, default=limits.KV_TRANSFER_TIMEOUT_S, help="seconds"
    )
    p.add_argument(
        "--prefill-timeout", type=float, default=limits.PREFILL_TIMEOUT_S, help="seconds"
    )
    p.add_argument("--prefill-retries", type=int, default=1)
    p.add_argument(
        "--max-inflight", type=int, default=256, help="requests holding KV blocks at once"
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=1024,
        help="requests waiting (holding nothing) for KV blocks; past it RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--ttft-slo-ms",
        type=float,
        default=None,
        help="default time-to-first-token target: a request predicted to miss it is refused "
        "at once (429 / RESOURCE_EXHAUSTED with Retry-After); default none",
    )
    p.add_argument(
        "--itl-slo-ms",
        type=float,
        default=None,
        help="default inter-token latency target: new requests wait while joining the decode "
        "batch would make its measured step time exceed it; default none",
    )
    p.add_argument(
        "--health-check-interval",
        type=float,
        default=limits.HEALTH_CHECK_INTERVAL_S,
        help="seconds",
    )
