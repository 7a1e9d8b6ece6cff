"""Smoke test of `pdserve bench grammars --quick`: both grammar libraries (xgrammar where the
`structured` extra is installed) compile and walk the same schemas on the tiny model and the JSON
has the documented shape; the backend the caller had chosen is left as it was. No timing
assertions: these machines are shared and noisy; the numbers live in docs/api.md."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest


def test_grammars_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.bench import grammars

    monkeypatch.setenv("PDSERVE_GRAMMAR_BACKEND", "llguidance")
    result = grammars.main(["--quick", "--out", str(tmp_path)])
    assert os.environ["PDSERVE_GRAMMAR_BACKEND"] == "llguidance"
    on_disk = json.loads((tmp_path / "grammars.json").read_text())
    assert on_disk["benchmark"] == "grammars" == result["benchmark"]
    measured = ["llguidance"]
    if importlib.util.find_spec("xgrammar") is not None:
        measured.append("xgrammar")
    else:
        assert "pdserve[structured]" in on_disk["backends"]["xgrammar"]["skipped"]
    for name in measured:
        row = on_disk["backends"][name]
        assert 0 < row["compile_ms"]["median"] <= row["compile_ms"]["max"], row
        assert row["mask_fill_ms_batch32"]["median"] > 0 and row["grammar_bytes"] > 0, row


def test_grammars_is_a_bench_subcommand() -> None:
    from pdserve.cli.main import BENCHMARKS

    assert BENCHMARKS["grammars"] == "pdserve.bench.grammars"
