"""`pdserve plan`'s flags (the planner itself: pdserve/plan.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.log_level import log_level_arg


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`pdserve plan` and its flags (registered by pdserve/cli/tool_args.py)."""
    p = sub.add_parser("plan", help="prefill and decode nodes a workload needs (from a profile)")
    add_arguments(p)
    log_level_arg(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", type=Path, required=True, help="profile.json (bench profile)")
    p.add_argument("--ttft-slo-ms", type=float, required=True, help="TTFT target, ms")
    p.add_argument("--itl-slo-ms", type=float, required=True, help="ITL target (mean), ms")
    p.add_argument("--rate", type=float, required=True, help="arrival rate, requests/s")
    p.add_argument("--prompt-len", type=int, required=True, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, required=True, help="output tokens per request")
    p.add_argument("--max-nodes", type=int, default=16, help="nodes at most, all kinds together")
    p.add_argument("--quantile", type=float, default=0.9, help="TTFT quantile the target holds at")
    p.add_argument("--json", action="store_true", help="the plan as JSON on stdout")
