"""`pdserve bench` without the optional `bench` extra: a benchmark whose baseline needs
transformers says which extra to install (exit 2) instead of a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdserve.cli.main import main


def test_bench_without_transformers_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    assert main(["bench", "engine", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs transformers" in err and "pip install 'pdserve[bench]'" in err
