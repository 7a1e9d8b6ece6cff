"""The flags of `pdserve up`, the local cluster: how many nodes of each role it starts and keeps
up, and every flag of the node commands it starts (`pdserve prefill`, `pdserve decode`), read
from their own parsers and passed on to the nodes that take them."""

from __future__ import annotations

import argparse
import copy

from pdserve.cli import node_args

# The node flags `up` sets itself, per node: the ports (the first decode node's, then counting
# up; ephemeral elsewhere), the prefill and encoder targets (its own --prefill and --encode are
# counts) and the listening host (its nodes find each other on loopback).
UP_SETS = frozenset(
    {"--port", "--http-port", "--metrics-port", "--prefill", "--encoder", "--host", "--help"}
)
NODE_ROLES = ("prefill", "decode")


def node_parsers() -> dict[str, argparse.ArgumentParser]:
    """The parsers of the node commands `up` starts, as `pdserve` builds them."""
    root = argparse.ArgumentParser(add_help=False)
    sub = root.add_subparsers()
    node_args.add_prefill(sub)
    node_args.add_decode(sub)
    return {role: sub.choices[role] for role in NODE_ROLES}


def passed_on(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The flags of a node parser that `up` takes and passes on."""
    return [
        a
        for a in parser._actions
        if a.option_strings and not UP_SETS.intersection(a.option_strings)
    ]


def node_argv(a: argparse.Namespace, role: str) -> list[str]:
    """The flags of node command `role` that `a` (the parsed `up` line) holds away from their
    defaults, written back as command-line arguments: what `up` gives each `role` node."""
    argv: list[str] = []
    for action in passed_on(node_parsers()[role]):
        value = getattr(a, action.dest)
        if action.dest == "model" or value == action.default:  # the model: Cluster's own argument
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # store_true / store_false / store_const
            argv.append(flag)
        elif isinstance(value, list | tuple):  # append, nargs="+"
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def _add_node_flags(up: argparse.ArgumentParser) -> None:
    """Every flag of the node parsers, once (a flag both take is one `up` flag, given to both);
    a node flag that clashes with one of `up`'s own is an error here, not a silent drop."""
    groups = {role: up.add_argument_group(f"{role} nodes") for role in NODE_ROLES}
    seen: dict[str, argparse.Action] = {}
    for role, parser in reversed(node_parsers().items()):  # decode's first: it takes the most
        for action in passed_on(parser):
            if action.dest in seen:
                assert seen[action.dest].option_strings == action.option_strings, action.dest
                continue
            seen[action.dest] = action
            groups[role]._add_action(_as_given(action))


def _as_given(action: argparse.Action) -> argparse.Action:
    """`up`'s copy of a node flag. A value of a type of the flag's own (NAME=PATH, ...) is
    checked as the node would, and kept as typed (or as the type normalises the text): `up`
    passes it on, it need not read it, and str() of what such a type returns need not be what
    it reads back."""
    mine = copy.copy(action)
    convert = action.type
    if callable(convert) and convert not in (int, float, str):

        def checked(text: str) -> str:
            value = convert(text)  # its error, as the node would give it
            # a normalised spelling (str.lower: --log-level INFO) is what the choices know
            return value if isinstance(value, str) else text

        checked.__name__ = getattr(convert, "__name__", "value")
        mine.type = checked
    return mine


def add_up(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="start a local cluster (separate processes)")
    up.add_argument("--prefill", type=int, default=1, help="number of prefill nodes")
    up.add_argument("--decode", type=int, default=1, help="number of decode nodes")
    up.add_argument(
        "--encode",
        type=int,
        default=0,
        help="number of encoder nodes: a vision model's images are encoded there for the prefill "
        "nodes (E/P/D; 0: each prefill node encodes its own)",
    )
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
    _add_node_flags(up)  # passed on to the nodes that take them
