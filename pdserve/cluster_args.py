"""The flags of `pdserve up`, the local cluster: the engine flags it passes on to every node,
and how many nodes of each role it starts and keeps up."""

from __future__ import annotations

import argparse

from pdserve.engine_args import engine_args
from pdserve.http_args import tool_call_parser_arg


def add_up(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="start a local cluster (separate processes)")
    engine_args(up)  # passed on to every node
    up.add_argument("--prefill", type=int, default=1, help="number of prefill nodes")
    up.add_argument("--decode", type=int, default=1, help="number of decode nodes")
    up.add_argument(
        "--max-restarts-per-minute",
        type=int,
        default=5,
        metavar="N",
        help="a node that exits unexpectedly is started again on its ports (after 0.5 s, "
        "doubling to 8 s), at most N times within any minute; then `up` stops (0: never)",
    )
    up.add_argument(
        "--port",
        type=int,
        default=None,
        help="first decode node's gRPC port (default: 50051; with --run, 0: ephemeral)",
    )
    up.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="first decode node's HTTP port (default: 8000; with --run, 0: ephemeral; -1: off)",
    )
    up.add_argument(
        "--run",
        metavar="PROMPT",
        default=None,
        help="start, stream one greedy answer to PROMPT (as a chat user message when the model "
        "has a chat template), then stop (the newcomer's demo)",
    )
    up.add_argument("--max-tokens", type=int, default=32, help="with --run")
    tool_call_parser_arg(up)  # passed on to the decode nodes
