"""`pdserve proxy`'s flags (pdserve/proxy.py)."""

from __future__ import annotations

import argparse

from pdserve.prefix_router import ROUTING_MODES
from shared.serving import tracing


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        required=True,
        help="HOST:PORT[,HOST:PORT...] of decode nodes; a DNS name stands for all its addresses",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=-1, help="-1 disables /metrics")
    p.add_argument("--http-port", type=int, default=-1, help="forward the HTTP API (-1: off)")
    p.add_argument("--backend-http-port", type=int, default=8000, help="decode nodes' HTTP port")
    p.add_argument(
        "--backend-http",
        default="",
        help="HOST:PORT[,...] of each --backend's HTTP API, in the same order (decode nodes "
        "sharing a host); unset: each backend's host on --backend-http-port",
    )
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds")
    p.add_argument("--max-attempts", type=int, default=3, help="backends tried per call")
    p.add_argument(
        "--max-resumes",
        type=int,
        default=2,
        help="times a Generate stream or an HTTP completion whose decode node failed "
        "mid-stream (or, HTTP, before answering) is continued on another node (0: never; the "
        "client gets the error)",
    )
    p.add_argument(
        "--routing",
        choices=ROUTING_MODES,
        default="kv",
        help="kv: where the prompt's prefix is likely cached, load considered; "
        "least-loaded: fewest calls in flight",
    )
    p.add_argument("--grace", type=float, default=30.0, help="drain time on SIGTERM, seconds")
    p.add_argument("--log-level", default="warning")
    tracing.endpoint_arg(p)
