"""`pdserve up` as a real process for tests: start it, find its nodes, read their metrics."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shared.serving.metrics import parse_prometheus_text


@dataclass
class Up:
    proc: subprocess.Popen[str]
    log: Path  # its stderr (and its nodes')
    grpc: str = ""  # the front door's HOST:PORT (one decode node: that node's)
    decodes: list[str] = field(default_factory=list)  # every decode node's HOST:PORT
    http: str = ""  # the front door's http://HOST:PORT (one decode node: that node's)
    stdout: list[str] = field(default_factory=list)

    def nodes(self, role: str) -> list[int]:
        """Pids of `up`'s live nodes of `role`, in start order."""
        found = [pid for pid in children(self.proc.pid) if f" {role} " in cmdline(pid)]
        return sorted(found)

    def wait_log(self, text: str, count: int = 1, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while self.log.read_text().count(text) < count:
            assert time.monotonic() < deadline, f"no {text!r} in: {self.log.read_text()[-3000:]}"
            assert self.proc.poll() is None or text in self.log.read_text(), self.tail()
            time.sleep(0.1)

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_up(tmp_path: Path, *args: str, timeout: float = 120.0) -> Up:
    """`pdserve up --model tiny --port 0 --http-port 0 ARGS`, returned once it serves."""
    log = tmp_path / "up.log"
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", "tiny", "--port", "0"]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [*cmd, "--http-port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=os.environ.copy(),
        )
    up = Up(proc, log)
    ready = threading.Event()

    def pump() -> None:  # read everything, so that `up` never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            up.stdout.append(line)
            if line.startswith("endpoint: "):
                up.grpc = line.split()[1]
                # after the front door, where there is one: each decode node's own
                nodes = line.split("decode nodes: ", 1)[-1]
                up.decodes = list(dict.fromkeys(re.findall(r"127\.0\.0\.1:\d+", nodes)))
            elif line.startswith("HTTP (OpenAI API): "):
                up.http = line.split()[3].removesuffix("/v1")
            elif line.startswith("try: "):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(timeout) or not up.grpc:
        up.stop()
        raise AssertionError(f"pdserve up did not come up: {up.tail()}")
    return up


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        ppid = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
        state = next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))
        if int(ppid) == pid and state != "Z":
            found.append(int(entry))
    return found


def cmdline(pid: int) -> str:
    try:
        return " " + Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def flag(pid: int, name: str) -> str:
    """The value a node process was given for `name` (the last one: argparse's)."""
    words = cmdline(pid).split()
    return words[len(words) - 1 - words[::-1].index(name) + 1]


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        return parse_prometheus_text(resp.read().decode())
