"""`pdserve bench roofline --quick`: runs end to end on the tiny model and writes JSON of the
documented shape plus the roofline PNG. No timing assertions: the machine is shared and noisy;
the numbers live in docs/performance.md."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pdserve.bench import dtype_agreement, roofline
from pdserve.bench.roofline_models import attention_flops, linear_params, linear_shapes
from shared.model import panel_gemm
from shared.model.loader import tiny_config

OP_KEYS = {"op", "self_ms", "share", "calls"}
GEMM_OPS = {"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", panel_gemm.PROFILER_NAME}


def test_roofline_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_ATTENTION_CACHE", str(tmp_path / "attention.json"))
    result = roofline.main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "roofline.png").stat().st_size > 0
    on_disk = json.loads((tmp_path / "roofline.json").read_text())
    assert on_disk["benchmark"] == "roofline" == result["benchmark"]
    assert len(on_disk["load_average"]["start"]) == 3
    assert [b["threads"] for b in on_disk["bandwidth"]] == [1]
    assert all(b["read_gbps"] > 0 and b["copy_gbps"] > 0 for b in on_disk["bandwidth"])
    assert [(r["model"], r["dtype"]) for r in on_disk["runs"]] == [
        ("tiny", "fp32"),
        ("tiny", "bf16"),
    ]
    for run in on_disk["runs"]:
        assert run["linear_params"] == linear_params(tiny_config())
        assert set(run["attention"]["paths"]) == {"prefill", "decode"}
        assert [p["tokens"] for p in run["prefill"]] == [128, 512]
        for p in run["prefill"]:
            assert p["tokens_per_s"] > 0 and p["ceiling_gflops"] > 0
            assert abs(p["ratio"] - p["effective_gflops"] / p["ceiling_gflops"]) < 1e-9
            attention = attention_flops(tiny_config(), p["tokens"]) / 1e9
            assert p["attention_gflop"] == attention > 0
            total = (p["linear_gflop"] + attention) / p["seconds"]
            assert abs(p["with_attention_gflops"] - total) < 1e-6
            assert p["with_attention_ratio"] > p["ratio"]
            shares = p["time_share"]  # attention and the GEMMs both took time, all sums to 1
            assert shares["attention"] > 0 and shares["linear"] > 0 and shares["other"] >= 0
            assert abs(sum(shares.values()) - 1.0) < 1e-6 or shares["other"] == 0.0
        assert [d["batch"] for d in run["decode"]] == [1, 8]
        assert all(d["step_ms"] > 0 and d["bandwidth_ratio"] > 0 for d in run["decode"])
        for ceiling in run["matmul_ceiling"]:
            assert len(ceiling["shapes"]) == len(linear_shapes(tiny_config()))
        for step in ("prefill", "decode"):
            ops = run["profile"][step]["top_ops"]
            assert ops and all(set(o) == OP_KEYS for o in ops)
            assert any(o["op"] in GEMM_OPS for o in ops)  # the GEMMs show up
    greedy = on_disk["bf16_vs_fp32_greedy"]["tiny"]
    assert greedy["prompts"] == 2 and greedy["tokens_per_prompt"] == 8
    assert 0.0 <= greedy["share_identical"] <= 1.0 and len(greedy["first_divergence"]) == 2
    for checks in on_disk["targets"].values():
        assert set(checks) == {
            "prefill_ge_0_7x_matmul_ge_512_tokens",
            "decode_b1_ge_0_7x_bandwidth",
        }
        assert all(isinstance(c["met"], bool) for c in checks.values())


def test_attention_flops_count_the_keys_each_query_sees() -> None:
    """Causal: query i sees i + 1 keys; a window of w caps that at w (sliding-window layers)."""
    config = tiny_config()
    per_pair, layers = 4 * config.num_heads * config.head_dim, config.num_layers
    full, local = sum(i + 1 for i in range(10)), sum(min(i + 1, 4) for i in range(10))
    assert attention_flops(config, 10) == per_pair * layers * full
    windowed = dataclasses.replace(config, sliding_window=4, sliding_window_layers=(0,))
    assert attention_flops(windowed, 10) == per_pair * ((layers - 1) * full + local)


def test_agreement_finds_the_first_divergence() -> None:
    got = dtype_agreement.agreement(
        [[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[1, 2, 3], [4, 0, 6], [0, 8, 9]]
    )
    assert got["share_identical"] == 1 / 3
    assert got["first_divergence"] == [None, 1, 0]
    assert got["mean_first_divergence"] == 0.5
