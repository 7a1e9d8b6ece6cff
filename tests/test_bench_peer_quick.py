"""`pdserve bench peer --quick`: with the vLLM venv present, a tiny engine comparison whose JSON
and PNG have the documented shape; without it (CI), a `skipped` result that says why and how to
create the venv — CI never downloads vLLM. No timing assertions (shared, noisy machines)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from pdserve.bench import peer
from pdserve.bench.peers import vllm_offline, vllm_setup


def test_peer_quick(tmp_path: Path) -> None:
    result = peer.main(["--quick", "--out", str(tmp_path)])
    on_disk = json.loads((tmp_path / "peer.json").read_text())
    assert on_disk["benchmark"] == "peer" and on_disk["quick"] is True
    assert len(on_disk["load_average"]) == 3
    if not vllm_setup.venv_ready():
        assert (
            "never installs vLLM" in on_disk["skipped"]
            and str(vllm_setup.VENV) in result["skipped"]
        )
        pytest.skip(on_disk["skipped"])
    assert (tmp_path / "peer_engine.png").stat().st_size > 0
    (row,) = on_disk["engine"]["rows"]
    assert row["dtype"] == "float32" and row["max_batch_size"] == 4 and row["requests"] == 4
    assert row["pdserve_tokens_per_s"] > 0 and row["vllm_tokens_per_s"] > 0
    ours, theirs = row["pair_tokens_per_s"]["pdserve"], row["pair_tokens_per_s"]["vllm"]
    assert len(ours) == len(theirs) == 1  # one pair in a quick run
    assert row["pair_ratios"] == pytest.approx([ours[0] / theirs[0]])
    assert row["ratio"] == pytest.approx(row["pair_ratios"][0])
    assert 0 <= row["agreement"]["identical"] <= row["agreement"]["of"] == 4
    assert sorted(row["order"]) == ["pdserve", "vllm"]


def test_a_row_of_pairs_is_their_medians() -> None:
    """Three pairs of runs (no vLLM needed): each pair's ratio, the row's the median of those;
    startup and agreement from the first pair."""
    outputs = [[1, 2, 3], [4, 5]]

    def run(ours: float, theirs: float) -> tuple[list[str], dict[str, dict[str, object]]]:
        got = {"tokens_per_s": ours, "startup_s": 1.0, "outputs": outputs}
        peer_run = {"tokens_per_s": theirs, "startup_s": 9.0, "outputs": [[1, 2, 9], [4, 5]]}
        return ["vllm", "pdserve"], {"pdserve": got, "vllm": peer_run}

    row = vllm_offline._row("float32", 4, 2, [run(30, 10), run(20, 20), run(50, 10)])
    assert row["pair_ratios"] == pytest.approx([3.0, 1.0, 5.0])
    assert row["ratio"] == pytest.approx(statistics.median([3.0, 1.0, 5.0])) == 3.0
    assert (row["pdserve_tokens_per_s"], row["vllm_tokens_per_s"]) == (30, 10)
    assert row["startup_s"] == {"pdserve": 1.0, "vllm": 9.0}
    assert row["agreement"]["of"] == 2 and row["agreement"]["identical"] == 1


def test_peer_quick_skips_without_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CI path, also on a machine that has the venv: the venv's place is an empty folder."""
    monkeypatch.setattr(vllm_setup, "VENV", tmp_path / "no-venv")
    result = peer.main(["--quick", "--out", str(tmp_path / "out")])
    assert "skipped" in result and str(tmp_path / "no-venv") in result["skipped"]
    assert "engine" not in json.loads((tmp_path / "out" / "peer.json").read_text())
