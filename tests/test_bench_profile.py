"""`pdserve bench profile --quick` on real nodes writes a profile `pdserve plan` reads; the
plan-check's choice of configurations and its verdict on measured records."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench import plan_check
from pdserve.bench import profile as bench_profile
from pdserve.bench.support import models
from pdserve.bench.support.load import RequestRecord, RequestSpec
from pdserve.plan import make_plan
from pdserve.planner_model import Targets, Workload
from pdserve.planner_profile import PROFILE_SCHEMA, PROFILE_VERSION, Profile
from shared.model.loader import tiny_config
from tests.support.cluster import pd_cluster


def _record(start: float, times: list[float], error: str | None = None) -> RequestRecord:
    return RequestRecord(
        RequestSpec([1], len(times)), start, times, [1] * len(times), times[-1], error
    )


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """`bench profile --quick` once: its directory and what main returned."""
    out = tmp_path_factory.mktemp("profile")
    return out, bench_profile.main(["--quick", "--out", str(out)])


def test_quick_profile_on_real_nodes_is_a_plannable_profile(
    quick_profile: tuple[Path, dict[str, Any]],
) -> None:
    tmp_path, result = quick_profile
    data = json.loads((tmp_path / "profile.json").read_text())
    assert data == json.loads(json.dumps(result))
    assert (data["schema"], data["version"]) == (PROFILE_SCHEMA, PROFILE_VERSION)
    # tiny: 4 layers x 2 KV heads x head dim 32 x (K, V) x 4 bytes
    assert data["transfer"]["bytes_per_token"] == 4 * 2 * 32 * 2 * 4
    assert all(s > 0 for s in data["prefill"]["seconds"])
    assert all(s > 0 for row in data["decode"]["step_s"] for s in row)
    assert data["decode"]["batches"] == [1, 4] and data["local_prefill"]["tokens"] == [128]
    profile = Profile.from_dict(data)
    plan = make_plan(profile, Workload(0.5, 64, 8), Targets(5.0, 1.0), max_nodes=4)
    assert plan.recommended is not None  # an idle node meets second-scale targets
    if (tmp_path / "profile.png").exists() is False:
        pytest.importorskip("matplotlib")  # the plot is optional: only missing without it
        raise AssertionError("no profile.png although matplotlib is installed")


def test_steady_gaps_are_taken_while_every_request_decodes() -> None:
    a = _record(0.0, [1.0, 1.1, 1.2, 1.3, 1.4, 1.5])
    b = _record(0.0, [1.25, 1.32, 1.39, 1.46, 1.6])  # joined late: a's early gaps are batch 1
    gaps = bench_profile.steady_gaps([a, b])
    assert gaps == pytest.approx([0.1, 0.1, 0.07, 0.07, 0.07])  # from 1.25 to 1.5 only


def test_plan_check_compares_the_recommendation_with_one_node_fewer() -> None:
    data = {
        "schema": PROFILE_SCHEMA,
        "version": PROFILE_VERSION,
        "chunk_tokens": 512,
        "prefill": {"tokens": [128, 1024], "seconds": [0.02, 0.16]},
        "transfer": {"tokens": [128, 1024], "seconds": [0.002, 0.004]},
        "local_prefill": {"tokens": [64, 512], "extra_s": [0.01, 0.08]},
        "decode": {"contexts": [128], "batches": [1, 32], "step_s": [[0.005, 0.02]]},
    }
    plan = make_plan(Profile.from_dict(data), Workload(3.0, 1024, 32), Targets(0.5, 0.006), 2)
    assert plan.recommended is not None and plan.recommended.kind == "disaggregated"
    assert plan_check.configurations(plan) == {"recommended": (1, 1), "one_node_fewer": (0, 1)}


def test_plan_check_verdict_needs_both_targets_and_no_failure() -> None:
    targets = Targets(ttft_s=0.5, itl_s=0.05)
    fast = [_record(0.0, [0.01 * i + 0.2, 0.01 * i + 0.22, 0.01 * i + 0.24]) for i in range(10)]
    verdict = plan_check.measured(fast, targets)
    assert verdict["meets"] and verdict["ttft_p90_ms"] == pytest.approx(281.0)
    assert verdict["itl_mean_ms"] == pytest.approx(20.0)
    late = [_record(0.0, [0.01 * i + 0.45, 0.01 * i + 0.47]) for i in range(10)]
    assert not plan_check.measured(late, targets)["meets_ttft"]  # p90 0.531 s > 0.5 s
    slow_itl = [_record(0.0, [0.2, 0.3, 0.4]) for _ in range(10)]
    assert not plan_check.measured(slow_itl, targets)["meets_itl"]
    failed = [*fast, _record(0.0, [9.0], error="RESOURCE_EXHAUSTED: full")]
    assert not plan_check.measured(failed, targets)["meets"]


def test_quick_plan_check_runs_both_configurations_on_real_nodes(
    quick_profile: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """`bench plan-check --quick` on the profile above: the plan's recommendation and the
    configuration with one node fewer both run on real nodes and are judged (on this noisy
    machine the verdicts themselves are not asserted: docs/performance.md has a real check)."""
    profile = quick_profile[0] / "profile.json"
    result = plan_check.main(["--quick", "--profile", str(profile), "--out", str(tmp_path)])
    assert json.loads((tmp_path / "plan_check.json").read_text()) == json.loads(json.dumps(result))
    runs = result["runs"]
    assert runs, result["plan"]
    for run in runs.values():
        if "skipped" not in run:
            assert run["completed"] == 8 and run["failed"] == 0, run
            assert isinstance(run["meets"], bool)


def test_a_model_that_is_not_built_in_is_described_by_its_node(tmp_path: Path) -> None:
    """Any model a node takes can be profiled: its context, vocabulary and KV bytes per token
    come from the node serving it, the same as the built-in tiny's written-down ones."""
    tiny = models.resolve("tiny", tmp_path)
    with pytest.raises(ValueError, match="a GGUF file or a model directory"):
        models.resolve(str(tmp_path / "missing"), tmp_path)
    other = models.BenchModel("tiny-by-node", "tiny", 0, 0, 0)

    async def body() -> models.BenchModel:
        async with pd_cluster("tiny") as c:
            return await models.described(other, c.targets[0])

    got = asyncio.run(body())
    assert (got.max_context, got.kv_bytes_per_token) == (tiny.max_context, tiny.kv_bytes_per_token)
    # every token id the model takes (the built-in entry draws prompts from the 256 bytes only)
    assert got.prompt_vocab == tiny_config().vocab_size
