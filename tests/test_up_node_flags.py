"""`pdserve up` takes every flag of the node commands it starts (read from their parsers, not a
kept list) and gives each node the ones its command takes, as the node's parser reads them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.cli.cluster_args import UP_SETS, node_argv, node_parsers, passed_on
from pdserve.cli.parser import build_parser
from tests.up_process import flag, start_up

_REQUIRED = {"prefill": [], "decode": ["--prefill", "127.0.0.1:1"]}


def _other_value(action: argparse.Action) -> list[str]:
    """Command-line words that give `action` a value away from its default."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [action.option_strings[1 if action.default else 0]]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, str(next(c for c in action.choices if c != action.default))]
    if action.type is int:
        return [flag, str((action.default or 0) + 7)]
    if action.type is float:
        return [flag, str((action.default or 0.0) + 2.5)]
    for text in ("value-7", "name7=value-7"):  # a type of the flag's own takes one of them
        try:
            if callable(action.type):
                action.type(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            continue
        return [flag, text]
    raise AssertionError(f"no test value for {flag}")


def _cases() -> list[tuple[str, str]]:
    """Every passed-on flag but --model (Cluster gives it to every node itself)."""
    found = [(role, a.dest) for role, p in node_parsers().items() for a in passed_on(p)]
    return [(role, dest) for role, dest in found if dest != "model"]


@pytest.mark.parametrize(("role", "dest"), _cases())
def test_each_node_flag_reaches_the_node_as_given(role: str, dest: str) -> None:
    (action,) = (a for a in passed_on(node_parsers()[role]) if a.dest == dest)
    words = _other_value(action)
    parser = build_parser()
    up = parser.parse_args(["up", *words])
    argv = node_argv(up, role)
    node = parser.parse_args([role, *_REQUIRED[role], *argv])
    direct = parser.parse_args([role, *_REQUIRED[role], *words])  # the flag given to the node
    assert getattr(node, dest) == getattr(direct, dest) != action.default, (words, argv)
    # nothing else changes: the other flags stay at the node's own defaults
    untouched = parser.parse_args([role, *_REQUIRED[role]])
    changed = {k for k, v in vars(node).items() if getattr(untouched, k) != v}
    assert changed == {dest}, changed


def test_the_flags_up_sets_itself_and_the_slo_flags() -> None:
    decode = {s for a in passed_on(node_parsers()["decode"]) for s in a.option_strings}
    for name in ("--ttft-slo-ms", "--itl-slo-ms", "--local-prefill-tokens", "--tool-call-parser"):
        assert name in decode
    assert not UP_SETS & decode
    a = build_parser().parse_args(["up", "--ttft-slo-ms", "900"])
    assert node_argv(a, "decode") == ["--ttft-slo-ms", "900.0"]
    assert node_argv(a, "prefill") == []  # a prefill node has no SLO flag
    assert node_argv(build_parser().parse_args(["up", "--model", "smollm2"]), "decode") == []


def test_up_starts_its_nodes_with_them(tmp_path: Path) -> None:
    up = start_up(
        tmp_path, "--ttft-slo-ms", "1500", "--local-prefill-tokens", "48", "--drain-grace", "3"
    )
    try:
        (decode,) = up.nodes("decode")
        (prefill,) = up.nodes("prefill")
        assert float(flag(decode, "--ttft-slo-ms")) == 1500
        assert flag(decode, "--local-prefill-tokens") == "48"
        assert float(flag(decode, "--drain-grace")) == float(flag(prefill, "--drain-grace")) == 3
        assert "--ttft-slo-ms" not in Path(f"/proc/{prefill}/cmdline").read_text()
    finally:
        assert up.stop() == 0, up.tail()
