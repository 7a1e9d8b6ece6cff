"""Two node processes drawing tqdm loading bars at the same time: through the cluster's stderr
relay one bar holds the line at a time and every log line arrives whole; written to one shared
stderr directly, the same two bars alternate on the line (the scenario really overlaps)."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from pdserve.cluster import popen_node
from pdserve.stderr_mux import StderrRelay

CHILD = """
import os, sys, time
from tqdm import tqdm
name, go = sys.argv[1], sys.argv[2]
print(f"{name} starting", file=sys.stderr, flush=True)
while not os.path.exists(go):
    time.sleep(0.01)
for i in tqdm(range(40), desc=f"loading {name}", file=sys.stderr, mininterval=0, leave=False):
    time.sleep(0.03)
    if i == 20:
        print(f"{name} halfway", file=sys.stderr, flush=True)
print(f"{name} done", file=sys.stderr, flush=True)
"""


def _bar_owners(text: str) -> list[str]:
    """Whose bar each drawn bar state is, in order (not a log line written over a bar)."""
    segments = re.split(r"[\r\n]", text)
    return [m.group(1) for s in segments if (m := re.fullmatch(r"loading (\w+): .*\]", s))]


def _switches(owners: list[str]) -> int:
    return sum(a != b for a, b in itertools.pairwise(owners))


def _wait_started(read: Path, names: tuple[str, ...]) -> None:
    deadline = time.monotonic() + 60
    while True:
        text = read.read_text()
        if all(f"{n} starting" in text for n in names):
            return
        assert time.monotonic() < deadline, text
        time.sleep(0.02)


def test_two_nodes_bars_take_turns_on_one_stderr(tmp_path: Path) -> None:
    log = tmp_path / "stderr"
    go = tmp_path / "go"
    with open(log, "w") as out:
        relay = StderrRelay(2, out.fileno())
    nodes = [
        popen_node(name, [sys.executable, "-c", CHILD, name, str(go)], echo=False, stderr=fd)
        for name, fd in zip(("alpha", "beta"), relay.fds, strict=True)
    ]
    _wait_started(log, ("alpha", "beta"))
    go.touch()
    for node in nodes:
        assert node.proc.wait(60) == 0
        assert node.lifeline is not None
        node.lifeline.close()
    assert relay.close()  # it copied everything and exited
    text = log.read_text()
    lines = text.split("\n")
    for name in ("alpha", "beta"):
        for what in ("starting", "halfway", "done"):
            # whole, at a line's end (a line printed over a bar follows the bar's text, as the
            # node wrote it)
            assert sum(line.endswith(f"{name} {what}") for line in lines) == 1, text
    owners = _bar_owners(text)
    assert owners and _switches(owners) <= 1, owners  # one bar, then (maybe) the other


def test_without_the_mux_the_same_bars_alternate(tmp_path: Path) -> None:
    log = tmp_path / "stderr"
    go = tmp_path / "go"
    with open(log, "w") as shared:
        procs = [
            subprocess.Popen([sys.executable, "-c", CHILD, name, str(go)], stderr=shared)
            for name in ("alpha", "beta")
        ]
        _wait_started(log, ("alpha", "beta"))
        go.touch()
        for proc in procs:
            assert proc.wait(60) == 0
    assert _switches(_bar_owners(log.read_text())) >= 2
    assert os.path.getsize(log) > 0
