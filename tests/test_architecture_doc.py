"""docs/architecture.md names each hop `file:function`; each must exist, so the page cannot rot."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
REF = re.compile(r"`([\w/]+\.py):([\w.]+)`")


def references() -> list[tuple[str, str]]:
    return REF.findall(DOC.read_text())


def defines(path: Path, dotted: str) -> bool:
    """Whether `path` defines `dotted` (a function or class, or Class.method) in its own body."""
    body: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        node = next(
            (
                n
                for n in body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and n.name == part
            ),
            None,
        )
        if node is None:
            return False
        body = node.body
    return True


def test_the_page_names_the_hops() -> None:
    # a request's path and a KV byte's path each take a dozen or more hops
    assert len(set(references())) >= 30


def test_every_named_hop_exists() -> None:
    missing = [
        f"{file}:{name}"
        for file, name in sorted(set(references()))
        if not (ROOT / file).is_file() or not defines(ROOT / file, name)
    ]
    assert not missing, f"docs/architecture.md names what the code does not define: {missing}"


def test_defines_sees_methods_and_rejects_strangers(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("class A:\n    async def go(self): ...\n\ndef f(): ...\n")
    assert defines(src, "A.go") and defines(src, "f") and defines(src, "A")
    assert not defines(src, "A.f") and not defines(src, "g")
