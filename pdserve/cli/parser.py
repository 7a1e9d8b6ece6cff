"""The `pdserve` parser: each subcommand's flags live with their group, in a module named after
it: node_args (prefill, decode, colocated), encode_args (encode), cluster_args (up), tool_args
(the rest)."""

from __future__ import annotations

import argparse

from pdserve.cli import cluster_args, encode_args, node_args, tool_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Prefill/decode disaggregated LLM serving"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cluster_args.add_up(sub)
    tool_args.add_export_hf(sub)
    node_args.add_prefill(sub)
    encode_args.add_encode(sub)
    node_args.add_colocated(sub, node_args.add_decode(sub))
    tool_args.add_proxy(sub)
    tool_args.add_plan(sub)
    tool_args.add_bench(sub)
    tool_args.add_generate(sub)
    tool_args.add_build_kernels(sub)
    return parser
