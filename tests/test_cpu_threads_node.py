"""A node process sizes torch's and the kernels' threads from the CPUs it may use, follows an
operator's `taskset -p` and a cgroup quota change while it runs, and starts its OpenMP runtime
with workers that sleep when idle. Real `pdserve colocated` processes (tiny model) under
taskset or in a cgroup; the node's log says what it chose."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cluster import NodeProcess, popen_node, stop_all, wait_ready
from shared.engine.runtime.cpu_budget import cgroup_cpu_dirs

START_TIMEOUT_S = 180.0
LOG_TIMEOUT_S = 60.0
# what the test process has (tests/conftest.py sets OMP_NUM_THREADS): the node must choose
_CHOSEN_BY_NODE = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "PDSERVE_CPU_SHARED_BY")


def _node_argv() -> list[str]:
    return [
        sys.executable,
        "-m",
        "pdserve.cli",
        "colocated",
        "--model",
        "tiny",
        "--port",
        "0",
        "--http-port",
        "0",
        "--metrics-port",
        "-1",
        "--num-kv-blocks",
        "64",
        "--log-level",
        "info",
    ]


def _start(prefix: list[str], log: Path) -> NodeProcess:
    env = {k: v for k, v in os.environ.items() if k not in _CHOSEN_BY_NODE}
    env["OMP_DISPLAY_ENV"] = "verbose"  # libgomp prints its settings on stderr as it loads
    with open(log, "w") as err:
        node = popen_node("colocated", [*prefix, *_node_argv()], echo=False, env=env, stderr=err)
    try:
        wait_ready([node], START_TIMEOUT_S)
    except BaseException:
        stop_all([node])
        raise
    return node


def _wait_for_log(log: Path, pattern: str, node: NodeProcess | None = None) -> re.Match[str]:
    """The first match of `pattern` in the node's log; while waiting, one short completion
    every few seconds makes the engine step (it reads its CPUs between steps)."""
    deadline = time.monotonic() + LOG_TIMEOUT_S
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text())
        if found:
            return found
        if node is not None:
            _complete(node)
        time.sleep(1.0)
    raise AssertionError(f"{pattern!r} not in the node's log:\n{log.read_text()[-3000:]}")


def _complete(node: NodeProcess) -> None:
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{node.info['http_port']}/v1/completions",
        data=body,
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def _threads_on(pid: int, cpus: str) -> list[Path]:
    """The threads of `pid` whose Cpus_allowed_list is `cpus`."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if f"Cpus_allowed_list:\t{cpus}\n" in (task / "status").read_text():
                found.append(task)
    return found


def _taskset(cpus: str, pid: int) -> None:
    subprocess.run(["taskset", "-p", "-c", cpus, str(pid)], check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs util-linux taskset")
def test_node_threads_follow_taskset(tmp_path: Path) -> None:
    log = tmp_path / "node.log"
    node = _start(["taskset", "-c", "0"], log)
    try:
        machine = os.cpu_count()
        _wait_for_log(log, rf"threads: 1 \(affinity 1 of {machine} CPUs; cgroup quota")
        assert "GOMP_SPINCOUNT = '0'" in log.read_text()  # OMP_WAIT_POLICY=PASSIVE took
        if not {0, 1} <= os.sched_getaffinity(0):
            pytest.skip("needs CPUs 0 and 1 for the change after start")
        _taskset("0,1", node.proc.pid)  # the main thread only, as an operator's `taskset -p`
        _wait_for_log(log, r"threads: 1 -> 2 \(affinity 2 of", node)
        # the engine thread took the main thread's new CPUs, so its team does not share CPU 0
        assert len(_threads_on(node.proc.pid, "0-1")) >= 2
        _taskset("1", node.proc.pid)
        _wait_for_log(log, r"threads: 2 -> 1 \(affinity 1 of", node)
        _complete(node)  # still serves after both moves
    finally:
        assert stop_all([node]) == 0


@pytest.fixture
def quota_cgroup() -> Iterator[Path]:
    """A cgroup of its own, one CPU of quota, where this process may make one (root, a
    writable cpu controller); skipped elsewhere."""
    made = None
    for version, directory, _ in cgroup_cpu_dirs():
        candidate = directory / f"pdserve-test-{os.getpid()}"
        try:
            candidate.mkdir()
        except OSError:
            continue
        made = candidate
        _set_quota(version, candidate, 1.0)
        break
    if made is None:
        pytest.skip("no writable cgroup with a cpu controller")
    try:
        yield made
    finally:
        deadline = time.monotonic() + 10.0
        while made.exists() and time.monotonic() < deadline:
            try:
                made.rmdir()  # once the node's process has left it
            except OSError:
                time.sleep(0.2)


def _set_quota(version: str, cgroup: Path, cpus: float) -> None:
    if version == "v2":
        (cgroup / "cpu.max").write_text(f"{int(cpus * 100000)} 100000\n")
    else:
        (cgroup / "cpu.cfs_period_us").write_text("100000\n")
        (cgroup / "cpu.cfs_quota_us").write_text(f"{int(cpus * 100000)}\n")


def test_node_threads_follow_a_cgroup_quota(tmp_path: Path, quota_cgroup: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip("a one-CPU quota only shows on a process with two CPUs or more")
    log = tmp_path / "node.log"
    join = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(quota_cgroup)]
    node = _start(join, log)
    try:
        _wait_for_log(log, rf"threads: 1 \(affinity {cpus} of \d+ CPUs.*; cgroup quota 1 CPUs")
        version = "v2" if (quota_cgroup / "cpu.max").exists() else "v1"
        _set_quota(version, quota_cgroup, 2.0)  # `docker update --cpus 2`
        _wait_for_log(log, r"threads: 1 -> 2 \(.*cgroup quota 2 CPUs", node)
    finally:
        assert stop_all([node]) == 0
