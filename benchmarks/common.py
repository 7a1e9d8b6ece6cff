"""Helpers every benchmark shares: output files, progress, the plot."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import torch


def environment() -> dict[str, Any]:
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")


def bar_plot(
    path: Path, title: str, groups: list[str], series: dict[str, list[float]], ylabel: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
