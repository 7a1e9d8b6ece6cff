"""Every command works installed: each `pdserve` subcommand's --help and each
`pdserve bench NAME --quick`, run through the installed console script from an empty working
directory, with only the packages the wheel ships importable (no repository root, no `tests`:
what a user who ran `pip install pdserve` has)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pdserve.cli.main import BENCHMARKS, build_parser

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("pdserve")


def _subcommands() -> list[str]:
    actions = build_parser()._actions
    sub = next(a for a in actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def _shipped_packages() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({pattern.rstrip("*").rstrip(".") for pattern in include})


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a user with this checkout's packages installed (as links, so the
    code under test is this worktree's) and nothing else of the repository on the path."""
    if not SCRIPT.exists():
        pytest.skip(f"no installed console script at {SCRIPT} (pip install -e .)")
    site = tmp_path_factory.mktemp("site")
    for name in _shipped_packages():
        (site / name).symlink_to(REPO / name, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return env


def _run(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_shipped_packages_do_not_include_tests() -> None:
    assert "tests" not in _shipped_packages()
    assert {"pdserve", "shared"} <= set(_shipped_packages())
    assert "benchmarks" not in _shipped_packages()


@pytest.mark.parametrize("command", [None, *_subcommands()])
def test_help(command: str | None, installed: dict[str, str], tmp_path: Path) -> None:
    args = ["--help"] if command is None else [command, "--help"]
    done = _run(args, installed, tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"usage: pdserve{'' if command is None else ' ' + command}")


# each of these also runs --quick in-process in its own test (tests/test_benchmarks_quick.py,
# test_roofline_quick.py, test_bench_structured.py, test_bench_profile.py,
# test_bench_peer_quick.py): the installed command runs the rest
IN_PROCESS = {
    "ttft",
    "serve",
    "transfer",
    "roofline",
    "structured",
    "profile",
    "plan-check",
    "peer",
}
BENCH_CASES = sorted(set(BENCHMARKS) - IN_PROCESS)


@pytest.mark.parametrize("name", BENCH_CASES)
def test_bench_quick(name: str, installed: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _run(["bench", name, "--quick", "--out", str(out)], installed, tmp_path, timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    assert list(out.glob("*.json")), f"bench {name} wrote no results into {out}"
