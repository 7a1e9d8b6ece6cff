"""`--log-level`, which every command takes: logs go to stderr at this level, so that a
command's own output on stdout stays its own."""

from __future__ import annotations

import argparse

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> argparse.Action:
    return p.add_argument(
        "--log-level",
        default="warning",
        type=str.lower,
        choices=LOG_LEVELS,
        help="logging on stderr (default: warning, so that a command's output stays its own)",
    )
