"""The `pdserve` command: parse, then hand over to the command's module. Those modules are
imported only when their command runs: `--help`, `up`, `generate` and the tools never import
torch (a node command does, through its config's checks and the engine it starts)."""

from __future__ import annotations

import os
import sys

from shared.engine.scheduling import wait_policy

# First, before anything imports torch: its OpenMP runtime reads the wait policy once, on load
os.environ.update(wait_policy.node_defaults(sys.argv[1:2], os.environ))

import argparse
import faulthandler
import importlib
import logging

from pdserve.bench import BENCHMARKS
from pdserve.bound_ports import check_bound_ports, port_in_use_line
from pdserve.cli.parser import build_parser
from shared.serving.port_in_use import PortInUse
from transfer.errors import KvPortInUse

__all__ = ["BENCHMARKS", "build_parser", "main"]

BENCH_EXTRA = ("transformers", "accelerate")  # what the `bench` extra adds besides matplotlib


def cmd_bench(a: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHMARKS[a.name])
    try:
        module.main(a.args)
    except ModuleNotFoundError as e:
        if e.name not in BENCH_EXTRA:
            raise
        # the baselines (transformers' generate) and the checkpoints they build are the
        # optional `bench` extra, like the plots
        print(
            f"pdserve bench {a.name} needs {e.name}, which is not installed: "
            "pip install 'pdserve[bench]'",
            file=sys.stderr,
        )
        return 2
    return 0


# command -> "module:function" taking the parsed flags and returning the exit code
COMMANDS = {
    "up": "pdserve.cli.up_command:cmd_up",
    "generate": "pdserve.cli.generate_command:cmd_generate",
    "export-hf": "pdserve.export_hf:run",
    "proxy": "pdserve.proxy_main:run",
    "plan": "pdserve.plan:run",
    "build-kernels": "shared.model.kernel_build:run",
    "prefill": "pdserve.cli.node_command:run_node",
    "encode": "pdserve.cli.encode_args:run_encode",
    "decode": "pdserve.cli.node_command:run_node",
    "colocated": "pdserve.cli.node_command:run_node",
}


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def enable_crash_stacks() -> None:
    """A crash in native code (torch, UCX) leaves the Python stack of every thread on stderr.

    The process's own stderr, not `sys.stderr`: an embedding program (or pytest's capture) may
    have replaced the latter with an object that has no file descriptor.
    """
    stderr = sys.__stderr__
    if stderr is not None and not stderr.closed:
        faulthandler.enable(file=stderr)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    setup_logging(a.log_level)
    enable_crash_stacks()
    try:
        check_bound_ports(a)  # before anything slow starts
        if a.command == "bench":
            return cmd_bench(a)
        module, function = COMMANDS[a.command].split(":")
        return getattr(importlib.import_module(module), function)(a)
    except (PortInUse, KvPortInUse) as e:
        print(port_in_use_line(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
