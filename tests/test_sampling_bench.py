"""The sampler benchmark's --quick mode runs end to end and writes its documented JSON (no
timing assertions: the numbers live in docs/performance.md)."""

from __future__ import annotations

import json
from pathlib import Path


def test_sampler_benchmark_quick(tmp_path: Path) -> None:
    from pdserve.bench import sampler

    result = sampler.main(["--quick", "--out", str(tmp_path)])
    on_disk = json.loads((tmp_path / "sampler.json").read_text())
    assert on_disk["benchmark"] == result["benchmark"] == "sampler"
    (row,) = on_disk["rows"]
    assert row["model"] == "tiny" and row["batch"] == sampler.BATCH
    for mode in ("off", "on"):
        assert row[mode]["step_ms"] > 0 and row[mode]["sampler_ms"] > 0
    assert isinstance(on_disk["meets_target"], bool)
