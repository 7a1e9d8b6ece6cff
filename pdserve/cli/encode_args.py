"""The flags of `pdserve encode`, an encoder node (E/P/D: it runs a vision model's tower for
the prefill nodes started with --encoder)."""

from __future__ import annotations

import argparse
import sys

from pdserve.cli.tls_args import server_tls_args
from pdserve.log_level import log_level_arg
from shared.model.vision.embedding_cache import DEFAULT_EMBEDDING_CACHE_BYTES


def add_encode(sub: argparse._SubParsersAction) -> None:
    en = sub.add_parser("encode", help="run one encoder node (a vision model's tower, E/P/D)")
    en.add_argument("--model", required=True, help="a vision model's checkpoint directory")
    en.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the prefill nodes' dtype (their towers and this one then agree to the bit)",
    )
    en.add_argument("--host", default="127.0.0.1")
    en.add_argument("--port", type=int, default=50071)
    en.add_argument("--metrics-port", type=int, default=0, help="-1 disables /metrics")
    en.add_argument(
        "--cache-mb",
        type=int,
        default=DEFAULT_EMBEDDING_CACHE_BYTES >> 20,
        help="recent images' embeddings kept by content (MiB)",
    )
    server_tls_args(en)
    log_level_arg(en)


def run_encode(a: argparse.Namespace) -> int:
    from encode_node.config import EncodeNodeConfig
    from pdserve.cli.flags import from_args, server_tls
    from pdserve.nodes import run_encoder
    from shared.engine.runtime import cpu_threads

    try:
        config = from_args(EncodeNodeConfig, a, cache_bytes=a.cache_mb << 20, tls=server_tls(a))
        config.validate()
        cpu_threads.apply()  # torch's threads: the CPUs this process may use
    except ValueError as e:
        print(f"pdserve encode: invalid configuration: {e}", file=sys.stderr)
        return 2
    return run_encoder(config)
