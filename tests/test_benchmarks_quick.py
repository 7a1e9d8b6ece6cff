"""Smoke tests of the benchmarks' --quick modes: each runs end to end into a temporary directory
and writes JSON of the documented shape plus a PNG. No timing assertions: these machines are
shared and noisy; the numbers themselves live in docs/performance.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LATENCY_KEYS = {"n", "mean", "p50", "p99", "min", "max"}
SERVING_KEYS = {"mean_ms", "median_ms", "p99_ms", "n"}


def _written(out: Path, name: str, result: dict[str, Any]) -> dict[str, Any]:
    assert (out / f"{name}.png").stat().st_size > 0
    on_disk = json.loads((out / f"{name}.json").read_text())
    assert on_disk["benchmark"] == result["benchmark"]
    return on_disk


def test_transfer_quick(tmp_path: Path) -> None:
    from pdserve.bench import transfer
    from pdserve.bench.support.transfer_methods import PDSERVE_PARTS

    result = _written(
        tmp_path, "transfer_loopback", transfer.main(["--quick", "--out", str(tmp_path)])
    )
    assert result["network"]["name"] == "loopback"
    assert set(result["idle"]) >= {"receiver_idle_cpu_percent", "receiver_waiting_cpu_percent"}
    assert [r["tokens"] for r in result["rows"]] == transfer.QUICK_TOKENS
    for row in result["rows"]:
        methods = row["methods"]
        assert set(methods) == set(transfer.METHODS)
        for name in (
            "pdserve_layerwise",
            "pdserve_whole",
            "pdserve_packed",
            "ucxx_contiguous",
            "grpc",
        ):
            m = methods[name]
            assert set(m["latency_s"]) == LATENCY_KEYS and m["latency_s"]["p50"] > 0
            assert m["gbps_p50"] > 0
            assert m["correct"] is True, f"{name}: blocks landed in the wrong place"
        assert set(methods["pdserve_layerwise"]["breakdown_p50_s"]) == set(PDSERVE_PARTS)
        assert methods["ucx_perftest"].get("gbps_p50", 0) > 0, methods["ucx_perftest"]
        nixl = methods["nixl"]
        assert "skipped" in nixl or nixl["correct"] is True
        assert set(row["ratios"]) == {f"vs_{m}" for m in transfer.METHODS if m != transfer.HEADLINE}
    for checks in (result["targets"], result["targets"]["whole_request"]):
        assert {
            "ge_90pct_of_ucx_perftest",
            "ge_50pct_of_ucx_perftest_2_16mib",
            "fixed_cost_p50_le_100us",
            "ge_1_5x_nixl",
            "ge_5x_grpc",
        } <= set(checks)
    assert "idle_lt_5pct_core" in result["targets"]


def test_ttft_quick(tmp_path: Path) -> None:
    from pdserve.bench import ttft

    result = _written(tmp_path, "ttft", ttft.main(["--quick", "--out", str(tmp_path)]))
    assert [r["tokens"] for r in result["rows"]] == ttft.QUICK_LENGTHS
    for row in result["rows"]:
        assert set(row["modes"]) == set(ttft.MODES)
        for mode, parts in row["modes"].items():
            assert set(parts) >= {*ttft.COMPONENTS, "node_ttft", "client_ttft", "first_decode_step"}
            assert parts["client_ttft"] > 0 and parts["prefill"] > 0, mode
        assert row["modes"]["colocated"]["tail"] == 0
        assert set(row["tail_over_prefill"]) == {"pd_layerwise", "pd_whole"}
        assert all(v is not None for v in row["pd_over_colocated_ttft"].values())
    assert len(result["samples"]) == sum(ttft.repeats(n, 1) for n in ttft.QUICK_LENGTHS) * len(
        ttft.MODES
    )
    assert set(result["idle_cpu_percent"]["tiny"]) == {
        "prefill",
        "decode",
        "decode-whole",
        "colocated",
    }
    assert set(result["targets"]) == {
        "layerwise_tail_le_10pct_prefill_ge_1k",
        "pd_ttft_le_1_1x_colocated_all_lengths",
        "pd_ttft_le_1_1x_colocated_ge_1k",
        "pd_ttft_le_1_05x_colocated_all_lengths_default_push",
        "pd_ttft_le_1_05x_colocated_all_lengths_both_pushes",
    }
    assert result["default_push"] == "pd_whole"  # both nodes on this host, CPU pools


def test_serve_quick(tmp_path: Path) -> None:
    from pdserve.bench import serve

    # the shared-prefix mode: every prompt starts with the same 32 tokens
    argv = ["--quick", "--out", str(tmp_path), "--prefix-len", "32", "--interference-rounds", "2"]
    result = _written(tmp_path, "serve", serve.main(argv))
    assert set(result["setups"]) == {"pd", "colocated"}
    for setup, r in result["setups"].items():
        load = r["load"]
        assert load["completed"] == result["workload"]["num_prompts"] and load["failed"] == 0, setup
        assert load["request_throughput"] > 0 and load["output_throughput"] > 0
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert set(load[metric]) == SERVING_KEYS, metric
        assert load["goodput"]["slos_ms"] == {"ttft": 1000.0, "tpot": 50.0}
        inter = r["interference"]
        assert inter["failed"] == 0
        assert inter["decode_itl_alone_s"]["n"] > 0 and inter["p99_ratio"] is not None
        assert len(inter["rounds"]) == 2 and all(x["p99_ratio"] for x in inter["rounds"])
        assert set(r["idle_cpu_percent"]) == (
            {"prefill", "decode"} if setup == "pd" else {"colocated"}
        )
    assert set(result["targets"]) == {
        "pd_itl_p99_le_1_3x",
        "colocated_itl_p99_gt_2x",
        "idle_node_lt_5pct_core",
    }
