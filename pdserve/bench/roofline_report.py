"""What `pdserve bench roofline` reports beside its numbers: the torch-profiler breakdown of a
step and the roofline plot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

ATTENTION_RANGE = "pdserve::attention"  # shared/model/attention.py's PROFILE_RANGE
_GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"})


def top_ops(fn: Callable[[], object], limit: int = 12) -> list[dict[str, Any]]:
    """torch.profiler self-CPU time per op of one call of `fn`, largest first."""
    return step_profile(fn, limit)["top_ops"]


def step_profile(fn: Callable[[], object], limit: int = 12) -> dict[str, Any]:
    """One call of `fn` under torch.profiler: its `top_ops` (self-CPU time per op, largest
    first) and `time_share`, the share of its CPU time in attention, in the linear layers'
    GEMMs and in the rest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = [
        {
            "op": e.key,
            "self_ms": e.self_cpu_time_total / 1e3,
            "share": e.self_cpu_time_total / total,
            "calls": e.count,
        }
        for e in events[:limit]
    ]
    return {"top_ops": ops, "time_share": time_shares(prof.events(), total)}


def _part(name: str) -> str | None:
    if name == ATTENTION_RANGE:
        return "attention"
    if name in _GEMM_OPS or "gemm" in name or "linear" in name:
        return "linear"
    return None


def time_shares(events: Any, total_us: float) -> dict[str, float]:
    """Share of `total_us` in attention and in GEMMs: each outermost event of a part counts
    with its children (the eager formula's matmuls inside attention count as attention)."""
    spent = {"attention": 0.0, "linear": 0.0}
    for e in events:
        part = _part(e.name)
        parent, nested = e.cpu_parent, False
        while parent is not None and not nested:
            nested, parent = _part(parent.name) is not None, parent.cpu_parent
        if part is not None and not nested:
            spent[part] += e.cpu_time_total
    shares = {part: us / total_us for part, us in spent.items()}
    return {**shares, "other": max(0.0, 1.0 - sum(shares.values()))}


def roofline_plot(path: Path, runs: list[dict[str, Any]], read_gbps: float) -> None:
    """Log-log roofline per model: min(matmul ceiling, bandwidth x intensity) per dtype, with
    the engine's prefill and decode points at intensity = FLOPs / weight bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in runs}, key=[r["model"] for r in runs].index)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    colors = {"fp32": "tab:blue", "bf16": "tab:orange"}
    for ax, model in zip(axes[0], models, strict=True):
        for run in (r for r in runs if r["model"] == model):
            color, dt = colors[run["dtype"]], run["dtype"]
            peak = max(m["gflops"] for m in run["matmul_ceiling"] if m["threads"] == 1)
            top = 2 * max(x["intensity"] for x in run["prefill"] + run["decode"])
            xs = [0.5 * 1.25**i for i in range(80) if 0.5 * 1.25**i <= top]
            ax.plot(xs, [min(peak, read_gbps * x) for x in xs], color=color, label=f"{dt} ceiling")
            pre = [p for p in run["prefill"] if p["threads"] == 1]
            ax.scatter(
                [p["intensity"] for p in pre],
                [p["effective_gflops"] for p in pre],
                color=color,
                marker="o",
                label=f"{dt} prefill",
            )
            dec = [d for d in run["decode"] if d["threads"] == 1]
            ax.scatter(
                [d["intensity"] for d in dec],
                [d["effective_gflops"] for d in dec],
                color=color,
                marker="^",
                label=f"{dt} decode",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("FLOP per weight byte")
        ax.set_ylabel("GFLOP/s (linear layers)")
        ax.set_title(f"{model}: roofline, 1 thread")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
