"""Smoke test of `pdserve bench structured --quick`: it runs end to end on the tiny model,
writes JSON of the documented shape plus a PNG, and both runs decode the same number of tokens
(each request its full length). No timing assertions: these machines are shared and noisy; the
numbers live in docs/performance.md."""

from __future__ import annotations

import json
from pathlib import Path


def test_structured_quick(tmp_path: Path) -> None:
    from pdserve.bench import structured

    result = structured.main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "structured_outputs.png").stat().st_size > 0
    on_disk = json.loads((tmp_path / "structured_outputs.json").read_text())
    assert on_disk["benchmark"] == "structured_outputs" == result["benchmark"]
    expected = result["batch"] * (result["tokens_per_request"] - 1)  # the first is prefill's
    for name in ("free", "json_schema"):
        assert [r["decoded_tokens"] for r in on_disk["runs"][name]] == [expected]
        assert on_disk["decode_tokens_per_s"][name] > 0
    rates = on_disk["decode_tokens_per_s"]
    assert on_disk["ratio"] == rates["json_schema"] / rates["free"]
    ttft = on_disk["ttft"]
    assert min(ttft["free_s"], ttft["cold_grammar_s"], ttft["cached_grammar_s"]) > 0
    assert len(on_disk["load_average"]["start"]) == 3


def test_structured_is_a_bench_subcommand() -> None:
    from pdserve.cli.main import BENCHMARKS
    from pdserve.cli.parser import build_parser

    assert BENCHMARKS["structured"] == "pdserve.bench.structured"
    args = build_parser().parse_args(["bench", "structured", "--quick"])
    assert args.name == "structured" and args.args == ["--quick"]
