"""The KV offload flags every node command takes (and `pdserve up` passes on): tiers below the
KV pool that keep evicted prefix blocks (shared/engine/connector/offload.py)."""

from __future__ import annotations

import argparse


def offload_args(g: argparse._ArgumentGroup) -> list[argparse.Action]:
    add = g.add_argument
    return [
        add(
            "--kv-offload-cpu-gb",
            type=float,
            default=0.0,
            help="host memory (GiB, allocated at start) keeping full KV blocks the prefix cache "
            "evicts; a prompt whose prefix is there loads it back instead of recomputing it. "
            "0: off (docs/deployment.md says when it pays on a CPU node)",
        ),
        add(
            "--kv-offload-disk-dir",
            default="",
            help="directory keeping the blocks the host tier lets go, one checksummed file each; "
            "reused after a restart (needs --kv-offload-cpu-gb and --kv-offload-disk-gb)",
        ),
        add(
            "--kv-offload-disk-gb",
            type=float,
            default=0.0,
            help="the disk tier's size in GiB (oldest blocks removed first)",
        ),
    ]
