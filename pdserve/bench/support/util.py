"""Helpers every benchmark shares: output files and environment, statistics, helper processes
driven by JSON lines, CPU and memory readings, plots."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[3]
REPLY_PREFIX = "BENCH-REPLY "


# ---- statistics ---------------------------------------------------------------------------------
def summarize(samples: Sequence[float]) -> dict[str, float]:
    """mean, median (p50), p99, min, max and count of `samples` (empty: zeros, n=0)."""
    if not samples:
        return {"n": 0, "mean": 0.0, "p50": 0.0, "p99": 0.0, "min": 0.0, "max": 0.0}
    xs = np.asarray(samples, dtype=np.float64)
    return {
        "n": len(xs),
        "mean": float(xs.mean()),
        "p50": float(np.percentile(xs, 50)),
        "p99": float(np.percentile(xs, 99)),
        "min": float(xs.min()),
        "max": float(xs.max()),
    }


def ratio(num: float, den: float) -> float | None:
    """num/den, None when the baseline is missing or zero (JSON null, never a division error)."""
    return num / den if num and den else None


# ---- machine ------------------------------------------------------------------------------------
def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages: these 2-core machines are shared, so every result
    records how busy the machine was while it was measured."""
    return [round(x, 2) for x in os.getloadavg()]


def process_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of every thread of `pid` (from /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # after the ")": state is field 3, utime 14 and stime 15 (1-based), so indices 11 and 12
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu_percent(pids: Sequence[int], seconds: float) -> dict[int, float]:
    """Percent of one core each process used over the next `seconds` (sampled from /proc)."""
    before = {pid: process_cpu_seconds(pid) for pid in pids}
    started = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - started
    return {pid: 100 * (process_cpu_seconds(pid) - before[pid]) / wall for pid in pids}


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so that `finally` blocks run: helper processes are stopped
    and network namespaces deleted even when the benchmark itself is terminated."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def child_env(**extra: str) -> dict[str, str]:
    """This environment plus the repo on PYTHONPATH (helpers run as `python -m pdserve.bench.*`)."""
    env = os.environ.copy()
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)
    env.update(extra)
    return env


def kill_group(proc: subprocess.Popen[Any], grace: float = 5.0) -> None:
    """SIGTERM the process group `proc` leads (started with start_new_session), then SIGKILL."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---- helper processes ---------------------------------------------------------------------------
class PeerError(RuntimeError):
    pass


class PeerProcess:
    """A helper in its own interpreter (UCX must not be forked), one JSON command per stdin line,
    one JSON reply per command on stdout behind REPLY_PREFIX (libraries may print too)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path):
        self.name = name
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.log_path = log_path
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY_PREFIX):
                self._replies.put(json.loads(line[len(REPLY_PREFIX) :]))
            else:
                self._log.write(line)
        self._replies.put(None)

    def call(self, cmd: str, timeout: float = 300.0, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            msg = f"{self.name} exited ({self.proc.poll()}); see {self.log_path}"
            raise PeerError(msg) from None
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise PeerError(f"{self.name}: no reply to {cmd} within {timeout:.0f}s") from None
        if reply is None:
            raise PeerError(f"{self.name} exited ({self.proc.wait()}); see {self.log_path}")
        if not reply.get("ok"):
            raise PeerError(f"{self.name}: {cmd} failed: {reply.get('error')}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(PeerError, OSError, ValueError):
                self.call("quit", timeout=15)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        kill_group(self.proc)
        self._log.close()


def peer_main_loop(handle: Any) -> None:
    """The helper side of PeerProcess: read commands, `await handle(cmd)`, reply. Runs on an
    asyncio loop; stdin is read on a thread so the loop stays free for UCX and gRPC."""
    import asyncio
    import traceback

    async def run() -> None:
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue[str | None] = asyncio.Queue()

        def read() -> None:
            for line in sys.stdin:
                loop.call_soon_threadsafe(lines.put_nowait, line)
            loop.call_soon_threadsafe(lines.put_nowait, None)

        threading.Thread(target=read, daemon=True).start()
        while (line := await lines.get()) is not None:
            cmd = json.loads(line)
            try:
                reply = {"ok": True, **(await handle(dict(cmd)) or {})}
            except Exception as e:  # reported to the driver, which decides
                traceback.print_exc()
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            print(REPLY_PREFIX + json.dumps(reply), flush=True)
            if cmd["cmd"] == "quit":
                return

    asyncio.run(run())


# ---- plots --------------------------------------------------------------------------------------
def pyplot() -> Any:
    """matplotlib's pyplot on the Agg back-end, or None (and one line saying so) where the
    optional `bench` extra is not installed: the JSON results never depend on it."""
    try:
        import matplotlib
    except ImportError:
        global _PLOT_NOTE_SHOWN
        if not _PLOT_NOTE_SHOWN:
            print("plots skipped: matplotlib is not installed (pip install 'pdserve[bench]')")
            _PLOT_NOTE_SHOWN = True
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_PLOT_NOTE_SHOWN = False


@contextlib.contextmanager
def figure(path: Path, ncols: int = 1, width: float = 7.0) -> Iterator[Any]:
    """A matplotlib figure with `ncols` axes, saved to `path` on exit. Callers check
    `pyplot()` first (plots are optional)."""
    plt = pyplot()
    assert plt is not None, "figure() needs matplotlib: check pyplot() first"

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, 4.2), squeeze=False)
    try:
        yield fig, list(axes[0])
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        print(f"wrote {path}")
    finally:
        plt.close(fig)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"


# ---- output ---------------------------------------------------------------------------------
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
    if pyplot() is None:
        return
    with figure(path) as (_, (ax,)):
        width = 0.8 / max(1, len(series))
        for i, (name, values) in enumerate(series.items()):
            ax.bar([g + i * width for g in range(len(groups))], values, width, label=name)
        ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
