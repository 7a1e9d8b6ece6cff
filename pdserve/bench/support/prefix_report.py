"""Targets, plot and summary of `pdserve bench serve --workload shared-prefix`
(pdserve/bench/serve_prefix.py): the benchmark's ratios computed from one run's modes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.support.util import figure, pyplot

KV_HIT_TARGET = 0.9  # kv routing's prefill prefix-hit rate >= 0.9x one shared cache's
TTFT_TARGET = 2.0  # least-loaded TTFT p50 >= 2x kv routing's


def ratio(num: float | None, den: float | None) -> float | None:
    """num/den; None when either is missing or the baseline is zero (a 0 hit rate stays 0)."""
    return None if num is None or not den else num / den


def _ttft_p50(result: dict[str, Any], mode: str) -> float | None:
    m = result["modes"].get(mode)
    return None if m is None else m["load"]["ttft"]["median_ms"]


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """kv hit / shared-cache hit and other TTFT p50 / kv TTFT p50, for every mode run (the
    benchmark's two targets are kv's hit ratio and least-loaded's TTFT ratio)."""
    shared = result["shared_cache"]["hit_rate"]
    modes = result["modes"]
    out: dict[str, Any] = {
        "hit_over_shared_cache": {m: ratio(r["hit_rate"], shared) for m, r in modes.items()},
        "ttft_p50_over_kv": {
            m: ratio(_ttft_p50(result, m), _ttft_p50(result, "kv")) for m in modes if m != "kv"
        },
    }
    kv_hit = out["hit_over_shared_cache"].get("kv")
    out["kv_hit_ge_0_9x_shared_cache"] = {
        "ratio": kv_hit,
        "target": KV_HIT_TARGET,
        "met": None if kv_hit is None else kv_hit >= KV_HIT_TARGET,
    }
    ll = out["ttft_p50_over_kv"].get("least-loaded")
    out["least_loaded_ttft_p50_ge_2x_kv"] = {
        "ratio": ll,
        "target": TTFT_TARGET,
        "met": None if ll is None else ll >= TTFT_TARGET,
    }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    if pyplot() is None:
        return
    modes = list(result["modes"])
    xs = np.arange(len(modes))
    with figure(path, ncols=3, width=5.0) as (_, axes):
        ax = axes[0]
        loads = [result["modes"][m]["load"]["ttft"] for m in modes]
        ax.bar(xs - 0.2, [t["median_ms"] for t in loads], 0.4, label="p50")
        ax.bar(xs + 0.2, [t["p99_ms"] for t in loads], 0.4, label="p99")
        ax.set_xticks(xs, modes)
        ax.set_ylabel("TTFT, ms")
        ax.set_title("time to first token")
        ax.legend(fontsize=7)
        ax = axes[1]
        ax.bar(xs, [result["modes"][m]["hit_rate"] for m in modes], 0.6)
        shared = result["shared_cache"]["hit_rate"]
        ax.axhline(shared, color="k", ls="--", lw=1, label=f"one shared cache: {shared:.2f}")
        ax.set_xticks(xs, modes)
        ax.set_ylim(0, 1)
        ax.set_ylabel("cached / prompt tokens, both prefill nodes")
        ax.set_title("prefill prefix-hit rate")
        ax.legend(fontsize=7)
        ax = axes[2]
        bottom = np.zeros(len(modes))
        for name in next(iter(result["modes"].values()))["prefill_nodes"]:
            for source, hatch in (("computed", ""), ("cached", "//")):
                vals = np.array([result["modes"][m]["prefill_nodes"][name][source] for m in modes])
                ax.bar(xs, vals, 0.6, bottom=bottom, hatch=hatch, label=f"{name} {source}")
                bottom += vals
        ax.set_xticks(xs, modes)
        ax.set_ylabel("prompt tokens")
        ax.set_title("where the prompt tokens went")
        ax.legend(fontsize=7)


def print_summary(result: dict[str, Any]) -> None:
    print(f"local prefill: {result['local_prefill']}")
    print(
        f"{'routing':>13} {'req/s':>6} {'out tok/s':>9} {'TTFT p50/p99 ms':>16} "
        f"{'hit rate':>8} {'÷shared':>7} {'per node computed/cached':>26}"
    )
    t = result["targets"]
    for mode, r in result["modes"].items():
        m = r["load"]
        split = " ".join(
            f"{n['computed']:.0f}/{n['cached']:.0f}" for n in r["prefill_nodes"].values()
        )
        print(
            f"{mode:>13} {m['request_throughput']:>6.2f} {m['output_throughput']:>9.1f} "
            f"{m['ttft']['median_ms']:>7.1f}/{m['ttft']['p99_ms']:<8.1f} {r['hit_rate']:>8.3f} "
            f"{t['hit_over_shared_cache'][mode] or 0:>7.3f} {split:>26}"
            + (f"  ({m['failed']} failed)" if m["failed"] else "")
        )
    s = result["shared_cache"]
    print(f"{'shared cache':>13} hit rate {s['hit_rate']:.3f} ({s['capacity_blocks']} blocks)")
    for mode, value in t["ttft_p50_over_kv"].items():
        print(f"  TTFT p50 {mode} / kv: {value or 0:.2f}x")
    for name in ("kv_hit_ge_0_9x_shared_cache", "least_loaded_ttft_p50_ge_2x_kv"):
        print(f"  {name}: {t[name]}")
    print(f"  load average: {result['load_average']}")
