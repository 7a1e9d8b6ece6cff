"""`pdserve bench transfer`'s targets for the push (its ratio to `ucx_perftest` by payload size,
its fixed cost, the receiver's idle CPU) and the summary it prints."""

from __future__ import annotations

from typing import Any

from pdserve.bench.support.util import human_bytes

HEADLINE = "pdserve_layerwise"
WHOLE = "pdserve_whole"  # the targets are checked for both
TARGET_BYTES = 16 << 20  # the 0.9x target applies to payloads at least this large
MID_BYTES = 2 << 20  # from here to TARGET_BYTES: at least 0.5x
FIXED_COST_BYTES = 32 << 10  # a push this small is its fixed cost
FIXED_COST_TARGET_S = 100e-6


def targets(
    rows: list[dict[str, Any]], idle: dict[str, float], ratios_key: str = "ratios"
) -> dict[str, Any]:
    """The benchmark's targets for the layer-wise push (`ratios`), or for the whole-request push
    (`ratios_whole`, nested under "whole_request")."""
    big = [r for r in rows if r["bytes"] >= TARGET_BYTES and "methods" in r]

    def worst(key: str) -> float | None:
        values = [r[ratios_key][key] for r in big if r[ratios_key].get(key) is not None]
        return min(values) if values else None

    checks = {
        "ge_90pct_of_ucx_perftest": (worst("vs_ucx_perftest"), 0.9),
        "ge_1_5x_nixl": (worst("vs_nixl"), 1.5),
        "ge_5x_grpc": (worst("vs_grpc"), 5.0),
    }
    out: dict[str, Any] = {
        name: {"worst_ratio": v, "target": goal, "met": None if v is None else v >= goal}
        for name, (v, goal) in checks.items()
    }
    mid = [
        r[ratios_key]["vs_ucx_perftest"]
        for r in rows
        if MID_BYTES <= r["bytes"] < TARGET_BYTES
        and r.get(ratios_key, {}).get("vs_ucx_perftest") is not None
    ]
    low = min(mid) if mid else None
    out["ge_50pct_of_ucx_perftest_2_16mib"] = {
        "worst_ratio": low,
        "target": 0.5,
        "met": None if low is None else low >= 0.5,
    }
    out["fixed_cost_p50_le_100us"] = fixed_cost(rows, HEADLINE if ratios_key == "ratios" else WHOLE)
    out["applies_to"] = f"payloads >= {human_bytes(TARGET_BYTES)} ({len(big)} sizes)"
    busiest = max(idle["receiver_idle_cpu_percent"], idle["receiver_waiting_cpu_percent"])
    out["idle_lt_5pct_core"] = {"cpu_percent": busiest, "target": 5.0, "met": busiest < 5.0}
    return out


def fixed_cost(rows: list[dict[str, Any]], method: str) -> dict[str, Any]:
    """p50 latency of the smallest payloads (<= FIXED_COST_BYTES): a push's fixed cost."""
    small = [
        r["methods"][method]["latency_s"]["p50"]
        for r in rows
        if r["bytes"] <= FIXED_COST_BYTES and "latency_s" in r.get("methods", {}).get(method, {})
    ]
    worst = max(small) if small else None
    return {
        "p50_s": worst,
        "target": FIXED_COST_TARGET_S,
        "met": None if worst is None else worst <= FIXED_COST_TARGET_S,
    }


def print_summary(result: dict[str, Any]) -> None:
    env, load = result["environment"], result["load_average"]
    start, end = load["start"][0], load["end"][0]
    print(f"{env['cpu']}, {env['cores']} cores, load average {start:.1f} -> {end:.1f}")
    print(f"{'shape':>9} {'payload':>9} {'mode':>10} {'p50':>10} {'p99':>10} {'GB/s':>7} perftest")
    for row in result["rows"]:
        for name, label in ((HEADLINE, "layer-wise"), (WHOLE, "whole")):
            m = row.get("methods", {}).get(name, {})
            if "latency_s" not in m:
                continue
            lat, vs = m["latency_s"], row["ratios" if name == HEADLINE else "ratios_whole"]
            perf = vs.get("vs_ucx_perftest")
            print(
                f"{row['shape']:>9} {human_bytes(row['bytes']):>9} {label:>10} "
                f"{lat['p50'] * 1e6:8.0f}us {lat['p99'] * 1e6:8.0f}us {m['gbps_p50']:7.2f} "
                + ("n/a" if perf is None else f"{perf:.2f}x")
            )
    t = result["targets"]
    for label, checks in (("layer-wise", t), ("whole-request", t["whole_request"])):
        print(f"targets, {label} push ({t['applies_to']}):")
        for name, check in checks.items():
            if isinstance(check, dict) and "target" in check:
                value = check.get("worst_ratio", check.get("cpu_percent", check.get("p50_s")))
                shown = "n/a" if value is None else f"{value:.3g}"
                print(f"  {name}: {shown} (target {check['target']}) met={check['met']}")
