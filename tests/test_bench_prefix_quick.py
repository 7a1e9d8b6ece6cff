"""`pdserve bench serve --workload shared-prefix --quick`: the prefill-routing comparison end to
end at tiny size (2 prefill nodes + 1 decode node per routing mode, the tiny model). Checks the
JSON's shape and what must hold whatever the timing: every request served, every prompt token
accounted for on a prefill node (local prefill is off), hit rates in [0, 1], nodes conserved.
No timing assertions (shared, noisy machines); the numbers live in docs/performance.md."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.bench import serve
from pdserve.bench.serve_prefix import PREFILLS, ROUTINGS
from pdserve.bench.support.workloads import SharedPrefixConfig

SERVING_KEYS = {"mean_ms", "median_ms", "p99_ms", "n"}


def test_serve_shared_prefix_quick(tmp_path: Path) -> None:
    result = serve.main(["--quick", "--workload", "shared-prefix", "--out", str(tmp_path)])
    assert (tmp_path / "serve_prefix.png").stat().st_size > 0
    on_disk = json.loads((tmp_path / "serve_prefix.json").read_text())
    assert on_disk["benchmark"] == result["benchmark"] == "serve_prefix"
    assert len(on_disk["load_average"]["start"]) == len(on_disk["load_average"]["end"]) == 3
    w = on_disk["workload"]
    config = SharedPrefixConfig(
        **{k: w[k] for k in SharedPrefixConfig.__dataclass_fields__}  # the recorded config
    )
    assert config.num_users == w["num_users"] >= 0
    assert set(on_disk["modes"]) == set(ROUTINGS)
    prompt_tokens = None
    for mode, r in on_disk["modes"].items():
        load = r["load"]
        assert load["completed"] == w["num_requests"] and load["failed"] == 0, mode
        assert load["request_throughput"] > 0
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert set(load[metric]) == SERVING_KEYS, metric
        assert set(r["prefill_nodes"]) == set(PREFILLS)
        kinds = r["ttft_by_kind"]
        assert kinds["user"]["n"] + kinds["conversation"]["n"] == w["num_requests"]
        total = r["prefill_prompt_tokens"]["cached"] + r["prefill_prompt_tokens"]["computed"]
        prompt_tokens = prompt_tokens or total
        assert total == prompt_tokens > 0, mode  # the same workload, all of it prefilled remotely
        assert 0.0 <= r["hit_rate"] <= 1.0
        assert set(r["exit_codes"].values()) == {0}, r["exit_codes"]  # seats and blocks back
        timing = r["node_timing_p50_ms"]
        assert set(timing) == {"queue", "prefill", "kv_transfer", "ttft"}, mode
        assert timing["ttft"] >= timing["prefill"] > 0, mode  # every prompt prefilled remotely
    shared = on_disk["shared_cache"]
    assert shared["cached"] + shared["computed"] == prompt_tokens
    assert 0.0 < shared["hit_rate"] <= 1.0  # the system prompts are shared: some hit
    t = on_disk["targets"]
    assert set(t["hit_over_shared_cache"]) == set(ROUTINGS)
    assert set(t["ttft_p50_over_kv"]) == {"least-loaded", "round-robin"}
    for name in ("kv_hit_ge_0_9x_shared_cache", "least_loaded_ttft_p50_ge_2x_kv"):
        assert set(t[name]) == {"ratio", "target", "met"}
