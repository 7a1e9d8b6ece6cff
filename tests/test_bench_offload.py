"""`pdserve bench offload --quick`: multi-turn conversations that outgrow the pool, the host tier
on and off in one run. Checks behaviour, never timing: the same greedy answers, more of each
prompt served from cache with the tier, JSON of the documented shape and the PNG."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.bench import offload
from pdserve.cli.main import main


def test_offload_bench_quick(tmp_path: Path) -> None:
    assert main(["bench", "offload", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "offload.json").read_text())
    assert (tmp_path / "offload.png").stat().st_size > 0
    assert result["benchmark"] == "offload_multi_turn" and result["outputs_equal"] is True
    w = result["workload"]
    assert w["history_tokens"] >= 2 * w["pool_tokens"]  # the histories outgrow the pool
    off, on = result["off"], result["on"]
    assert off["prompt_tokens"] == on["prompt_tokens"]
    assert on["prefix_hit_rate"] > off["prefix_hit_rate"] + 0.25
    assert result["ttft_ratio"] == on["ttft_p50_s"] / off["ttft_p50_s"]


def test_the_pool_holds_its_share_and_at_least_the_longest_prompt() -> None:
    w = offload.Workload(conversations=8, turns=4, turn_tokens=256, answer_tokens=16)
    blocks, total = offload.pool_blocks(w, 0.25, 16)
    assert total == 8 * 4 * 272 and blocks == total // 4 // 16
    lone = offload.Workload(conversations=1, turns=4, turn_tokens=256, answer_tokens=16)
    blocks, total = offload.pool_blocks(lone, 0.25, 16)
    assert blocks * 16 >= total + 16  # one conversation: the pool still holds its last turn
