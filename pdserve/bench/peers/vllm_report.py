"""The files `pdserve bench peer` writes: peer.json (everything) and one PNG per phase."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdserve.bench.support.util import bar_plot, figure, pyplot, write_json


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
        [
            f"{r['dtype'].replace('float', 'fp').replace('bfloat', 'bf')} b{r['max_batch_size']}"
            for r in rows
        ],
        {
            "pdserve LLM": [r["pdserve_tokens_per_s"] for r in rows],
            "vLLM LLM": [r["vllm_tokens_per_s"] for r in rows],
        },
        "output tokens / s",
    )


def _lines(
    path: Path, title: str, panels: list[tuple[str, dict[str, tuple[list, list]]]], xlabel: str
) -> None:
    if pyplot() is None:
        return
    with figure(path, ncols=len(panels), width=4.2) as (fig, axes):
        for ax, (ylabel, series) in zip(axes, panels, strict=True):
            for name, (xs, ys) in series.items():
                ax.plot(xs, ys, marker="o", label=name)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(title)


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
    _lines(
        path,
        "1 prefill + 1 decode, one core per node",
        [("TTFT p50 (ms)", series)],
        "prompt tokens",
    )


# ---- markdown (the tables in docs/performance.md come from here) -------------------------------
def markdown(result: dict[str, Any]) -> str:
    parts = []
    if "engine" in result:
        parts.append(_engine_table(result["engine"]["rows"]))
    if "serve" in result:
        parts.append(_serve_table(result["serve"]))
    if "pd" in result:
        parts.append(_pd_table(result["pd"]["ttft"]))
    return "\n\n".join(parts)


def _engine_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| dtype | batch limit | requests | pdserve tok/s | vLLM tok/s | ratio | identical"
        " | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a = r["agreement"]
        lines.append(
            f"| {r['dtype']} | {r['max_batch_size']} | {r['requests']} |"
            f" {r['pdserve_tokens_per_s']:.1f} | {r['vllm_tokens_per_s']:.1f} |"
            f" **{r['ratio']:.2f}x** | {a['identical']}/{a['of']} |"
            f" {r['load_average_before'][0]}-{r['load_average_after'][0]} |"
        )
    return "\n".join(lines)


def _serve_table(serve: dict[str, Any]) -> str:
    lines = [
        "| system | rate (req/s) | req/s | out tok/s | goodput (req/s) | TTFT p50 / p99 (ms) |"
        " TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for system, rows in serve["sweep"].items():
        for r in rows:
            lines.append(
                f"| {system} | {r['rate']} | {r['request_throughput']:.2f} |"
                f" {r['output_throughput']:.1f} | {r.get('request_goodput', 0):.2f} |"
                f" {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} |"
                f" {r['median_tpot_ms']:.0f} / {r['p99_tpot_ms']:.0f} |"
                f" {r['median_itl_ms']:.0f} / {r['p99_itl_ms']:.0f} | {r['load_average'][0]} |"
            )
    lines += [
        "",
        "| system | decode ITL p99 alone (ms) | with long prompts (ms)"
        " | long-prompt TTFT p50 (ms) |",
        "|---|---|---|---|",
    ]
    for system, r in serve["interference"].items():
        lines.append(
            f"| {system} | {r['decode_itl_alone_ms']['p99']:.0f} |"
            f" {r['decode_itl_with_long_prompts_ms']['p99']:.0f} |"
            f" {r['long_prompt_ttft_ms']['p50']:.0f} |"
        )
    return "\n".join(lines)


def _pd_table(ttft: dict[str, list[dict[str, Any]]]) -> str:
    systems = list(ttft)
    lengths = [r["prompt_tokens"] for r in ttft[systems[0]]]
    head = " | ".join(f"{s} TTFT p50 (ms)" for s in systems)
    lines = [f"| prompt tokens | {head} | ratio |", "|---|" + "---|" * (len(systems) + 1)]
    for i, n in enumerate(lengths):
        vals = [ttft[s][i]["ttft_ms_p50"] for s in systems]
        ratio = vals[0] / vals[1] if len(vals) > 1 and vals[1] else float("nan")
        cells = " | ".join(f"{v:.0f}" for v in vals)
        lines.append(f"| {n} | {cells} | **{ratio:.2f}x** |")
    return "\n".join(lines)


if __name__ == "__main__":
    import json
    import sys

    print(markdown(json.loads(Path(sys.argv[1]).read_text())))
