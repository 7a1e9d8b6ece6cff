"""Children die with their parent: nodes started by `pdserve up` (or by a harness) drain and exit
on their own once the process that started them is gone, however it went."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from pdserve.client import generate_stream, get_model_info
from pdserve.cluster import NodeProcess, spawn, stop_all, wait_ready
from tests.net_probe import listening_sockets
from tests.up_process import children

GONE_WITHIN_S = 3.0


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for an init that may never reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _listening_ports() -> set[int]:
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _start_up(tmp_path: Path) -> tuple[subprocess.Popen[str], str, Path]:
    log = tmp_path / "up.log"
    with open(log, "w") as err:
        up = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "up", "--port", "0", "--log-level", "info"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=os.environ.copy(),
        )
    assert up.stdout is not None
    deadline = time.monotonic() + 120
    for line in up.stdout:
        if line.startswith("endpoint: "):
            return up, line.split()[1], log
        assert time.monotonic() < deadline, "pdserve up did not come up"
    up.wait()
    raise AssertionError(f"pdserve up exited with {up.returncode}: {log.read_text()[-2000:]}")


def test_sigkilled_pdserve_up_takes_its_nodes_along(tmp_path: Path) -> None:
    """SIGKILL `pdserve up` with a stream in flight: both nodes drain (the stream ends), exit
    with their seats and blocks conserved, and every port they listened on is free in 3 s."""
    up, endpoint, log = _start_up(tmp_path)
    nodes: list[int] = []
    try:
        nodes.extend(children(up.pid))
        assert len(nodes) == 2, f"expected a prefill and a decode node, found {nodes}"
        ports = {port for pid in nodes for _, port in listening_sockets(pid)}
        assert len(ports) >= 4, f"gRPC and /metrics of both nodes, KV listener: {ports}"

        async def stream_then_kill() -> tuple[int, BaseException | None]:
            got = 0
            stream = generate_stream(endpoint, [5, 6, 7], max_tokens=400, ignore_eos=True)
            try:
                async for chunk in stream:
                    got += len(chunk.token_ids)
                    if got >= 2 and up.poll() is None:
                        up.send_signal(signal.SIGKILL)
            except grpc.RpcError as e:  # the drain may end the stream with UNAVAILABLE
                return got, e
            finally:
                await stream.aclose()
            return got, None

        got, error = asyncio.run(stream_then_kill())
        assert up.wait(10) == -signal.SIGKILL
        assert got < 400 or error is None  # the stream ended early, or finished first
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(_alive(pid) for pid in nodes) or ports & _listening_ports():
            assert time.monotonic() < deadline, (
                f"alive: {[p for p in nodes if _alive(p)]}, "
                f"still listening: {ports & _listening_ports()}"
            )
            time.sleep(0.05)
        text = log.read_text()
        assert text.count("lifeline closed") == 2, text[-3000:]
        assert text.count("every seat and block back in its pool") == 2, text[-3000:]
        assert "NOT conserved" not in text
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for pid in nodes:  # only if the test failed: they are gone otherwise
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_node_outlives_the_thread_that_spawned_it_then_follows_its_lifeline() -> None:
    """The lifeline is the process's, not the spawning thread's (PR_SET_PDEATHSIG would have
    killed this node when the thread ended); closing it (as the parent's death does) drains the
    node, which exits 0 (conserved) on its own."""
    spawned: list[NodeProcess] = []
    worker = threading.Thread(
        target=lambda: spawned.append(spawn("prefill", ["--port", "0"], echo=False))
    )
    worker.start()
    worker.join()
    node = spawned[0]
    try:
        wait_ready([node], 120)
        target = f"127.0.0.1:{node.info['port']}"
        info = asyncio.run(_model_info(target))
        assert info.vocab_size > 0
        assert node.proc.poll() is None
        assert node.lifeline is not None
        node.lifeline.close()
        assert node.proc.wait(GONE_WITHIN_S) == 0
    finally:
        stop_all([node], grace=5)


async def _model_info(target: str):
    return await get_model_info(target, service="prefill", timeout=10)
