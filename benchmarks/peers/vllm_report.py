"""The files `pdserve bench peer` writes: peer.json (everything) and one PNG per phase."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.support.util import bar_plot, write_json


def write(out: Path, result: dict[str, Any]) -> None:
    write_json(out / "peer.json", result)
    if "engine" in result:
        engine_plot(out / "peer_engine.png", result["engine"]["rows"])
    if "serve" in result:
        serve_plot(out / "peer_serve.png", result["serve"])
    if "pd" in result:
        pd_plot(out / "peer_pd.png", result["pd"])


def engine_plot(path: Path, rows: list[dict[str, Any]]) -> None:
    bar_plot(
        path,
        "Offline engine, output tokens/s (same cores, weights, prompts)",
        [f"{r['dtype'].replace('float', 'fp').replace('bfloat', 'bf')} b{r['max_batch_size']}"
         for r in rows],
        {
            "pdserve LLM": [r["pdserve_tokens_per_s"] for r in rows],
            "vLLM LLM": [r["vllm_tokens_per_s"] for r in rows],
        },
        "output tokens / s",
    )  # fmt: skip


def _lines(path: Path, title: str, panels: list[tuple[str, dict[str, tuple[list, list]]]],
           xlabel: str) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (ylabel, series) in zip(axes[0], panels, strict=True):
        for name, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def serve_plot(path: Path, serve: dict[str, Any]) -> None:
    panels: list[tuple[str, dict[str, tuple[list, list]]]] = []
    for metric, label in (
        ("p99_ttft_ms", "TTFT p99 (ms)"),
        ("p99_itl_ms", "ITL p99 (ms)"),
        ("request_goodput", "goodput (req/s)"),
    ):
        series = {}
        for system, rows in serve["sweep"].items():
            ok = [r for r in rows if metric in r]
            series[system] = ([r["rate"] for r in ok], [r[metric] for r in ok])
        panels.append((label, series))
    _lines(path, "Serving over OpenAI HTTP (vllm bench serve)", panels, "request rate (req/s)")


def pd_plot(path: Path, pd: dict[str, Any]) -> None:
    series = {
        system: ([r["prompt_tokens"] for r in rows], [r["ttft_ms_p50"] for r in rows])
        for system, rows in pd["ttft"].items()
    }
    _lines(path, "1 prefill + 1 decode, one core per node", [("TTFT p50 (ms)", series)],
           "prompt tokens")  # fmt: skip
