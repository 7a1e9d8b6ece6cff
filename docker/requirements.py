"""Print pdserve's runtime requirements (pyproject.toml [project].dependencies), one per line.

Used by docker/wheelhouse.sh on the host and by the Dockerfile in the build, so both install
exactly what the package declares; `--torch SPEC` replaces the torch requirement (e.g. the CPU
build `torch==2.13.0+cpu` for the offline wheelhouse); `--extra NAME` (repeatable) adds that
optional-dependency group's requirements (e.g. `structured`: xgrammar, for structured outputs).
Needs Python >= 3.11 (tomllib).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path


def requirements(pyproject: Path, torch: str | None, extras: Sequence[str] = ()) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    groups: dict[str, list[str]] = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in groups]
    if unknown:
        raise SystemExit(f"requirements.py: no optional dependencies {unknown} in {pyproject}")
    deps: list[str] = project["dependencies"] + [d for e in extras for d in groups[e]]
    out = []
    for dep in deps:
        name = re.split(r"[\s<>=!~;\[(]", dep, maxsplit=1)[0].lower()
        out.append(torch if name == "torch" and torch else dep)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("pyproject", type=Path, nargs="?", default=Path("pyproject.toml"))
    p.add_argument("--torch", default=None, help="replacement torch requirement")
    p.add_argument(
        "--extra", action="append", default=[], metavar="NAME", help="an optional group too"
    )
    a = p.parse_args(argv)
    reqs = requirements(a.pyproject, a.torch, a.extra)
    sys.stdout.write("".join(f"{r}\n" for r in reqs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
