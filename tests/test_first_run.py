"""A first run cannot trip: the README's main command answers a real question ("Paris"), binds no
fixed port and prints nothing but its answer and summary line on stdout; a command whose port
another socket holds says, in one line, which flag moves it and exits 2 (`pdserve up` passes a
node's line on as it is); `pdserve up` hands its engine flags to every node it starts. Real
processes, real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cli.engine_args import engine_argv
from pdserve.cli.parser import build_parser
from pdserve.client import get_model_info

QUESTION = "What is the capital of France?"
SUMMARY = r"\[finish=\w+ prompt_tokens=\d+ completion_tokens=\d+ cached_tokens=\d+ ttft=[\d.]+ms\]"
# a log record's start, wherever it is (one cut into the streamed answer, too)
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (?P<level>[A-Z]+) ")


def pdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", *args]


def in_use_line(port: int, flag: str) -> str:
    why = f"pdserve: port {port} is in use ({flag})"
    return f"{why}: choose another port or 0 for an ephemeral one\n"


def _listen(host: str, port: int) -> socket.socket | None:
    sock = socket.socket()
    try:
        sock.bind((host, port))
        sock.listen()
    except OSError as e:
        sock.close()
        if e.errno != errno.EADDRINUSE:
            raise
        return None
    return sock


@contextlib.contextmanager
def port_8000_taken() -> Iterator[None]:
    """Port 8000 held by a listening socket: ours on every address (else on loopback) when it
    is free, or whatever already holds it."""
    sock = _listen("0.0.0.0", 8000) or _listen("127.0.0.1", 8000)
    try:
        assert sock is not None or _listen("127.0.0.1", 8000) is None
        yield
    finally:
        if sock is not None:
            sock.close()


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    sock = _listen("127.0.0.1", 0)
    assert sock is not None
    with sock:
        yield sock.getsockname()[1]


def installed_pdserve() -> list[str]:
    """The venv's `pdserve` script, as a user runs it (the module where there is none)."""
    script = Path(sys.executable).parent / "pdserve"
    return [str(script)] if script.is_file() else pdserve()


def test_readme_command_answers_paris_on_stdout_alone_with_port_8000_taken() -> None:
    """The README's main command, as a user runs it (the installed script, the machine's own
    dtype default rather than the suite's fp32 pin, separate node processes): the answer names
    Paris, stdout is the answer and its summary line only, stderr shows the load's progress and
    no log line below WARNING, and another program holding port 8000 changes nothing."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert f'pdserve up --model smollm2 --run "{QUESTION}"' in readme
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_AUTO_DTYPE"}
    with port_8000_taken():
        done = subprocess.run(
            [*installed_pdserve(), "up", "--model", "smollm2", "--run", QUESTION],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "loading SmolLM2-135M-Instruct.Q4_1.gguf" in done.stderr  # the progress line
    out = re.fullmatch(rf"(?s)(?P<answer>.*)\n{SUMMARY}\n", done.stdout)
    assert out is not None, f"stdout is not the answer and its summary line: {done.stdout!r}"
    assert "Paris" in out["answer"], done.stdout
    assert not LOG_LINE.search(done.stdout), f"a log line on stdout: {done.stdout!r}"
    levels = {m["level"] for m in LOG_LINE.finditer(done.stderr)}
    assert levels <= {"WARNING", "ERROR", "CRITICAL"}, f"logged by default: {done.stderr!r}"


@pytest.mark.parametrize(
    ("command", "flag", "extra"),
    [
        ("decode", "--http-port", ["--prefill", "127.0.0.1:1"]),
        ("prefill", "--port", []),
        ("colocated", "--metrics-port", []),
        ("decode", "--ucx-port", ["--prefill", "127.0.0.1:1", "--port", "0", "--http-port", "0"]),
        ("proxy", "--port", ["--backend", "127.0.0.1:1"]),
    ],
)
def test_a_taken_port_is_one_line_naming_its_flag(
    command: str, flag: str, extra: list[str]
) -> None:
    with taken_port() as port:
        done = subprocess.run(
            pdserve(command, *extra, flag, str(port)),
            capture_output=True,
            text=True,
            timeout=120,
            env=os.environ.copy(),
        )
    assert (done.returncode, done.stdout, done.stderr) == (2, "", in_use_line(port, flag))


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
            if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")


def _wait_for_children(up: subprocess.Popen[str], count: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(children := _children(up.pid)) < count:
        assert up.poll() is None, f"pdserve up exited with {up.returncode}"
        assert time.monotonic() < deadline, f"pdserve up started {children} within {timeout}s"
        time.sleep(0.1)
    return children


def test_up_passes_a_nodes_port_line_on_and_exits_2(tmp_path: Path) -> None:
    """The HTTP port is free when `up` checks it and taken by the time its decode node starts
    (bound once the prefill node runs; the decode node starts after that one is ready)."""
    with taken_port() as port:
        pass  # a port that was free a moment ago
    err = tmp_path / "up.err"
    with open(err, "w") as stderr:
        up = subprocess.Popen(
            pdserve("up", "--model", "tiny", "--port", "0", "--http-port", str(port)),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=os.environ.copy(),
        )
    try:
        _wait_for_children(up, 1, 120)
        holder = _listen("127.0.0.1", port)
        assert holder is not None, f"port {port} was taken by someone else meanwhile"
        with holder:
            assert up.wait(240) == 2
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    text = err.read_text()
    assert text.count("is in use") == 1 and in_use_line(port, "--http-port") in text, text
    assert "pdserve up failed" not in text, text
    assert up.stdout is not None and up.stdout.read() == ""


def test_up_writes_its_engine_flags_back_as_a_node_reads_them() -> None:
    parser = build_parser()
    given = ["--dtype", "bfloat16", "--kv-cache-mb", "64", "--max-num-tokens", "128"]
    given += ["--kv-cache-memory-fraction", "0.05", "--num-kv-blocks", "7"]
    switches = ["--no-prefix-caching", "--no-cuda-graphs", "--log-level", "INFO"]
    up = parser.parse_args(["up", "--model", "smollm2", *given, *switches])
    node = parser.parse_args(["prefill", "--model", "smollm2", *engine_argv(up)])
    fields = ("dtype", "kv_cache_mb", "max_num_tokens", "no_prefix_caching", "cuda_graphs")
    fields += ("kv_cache_memory_fraction", "num_kv_blocks")
    for field in (*fields, "log_level"):
        assert getattr(node, field) == getattr(up, field), field
    assert node.log_level == "info" and not node.cuda_graphs and node.no_prefix_caching
    assert engine_argv(parser.parse_args(["up", "--model", "smollm2"])) == []  # --model: Cluster's


def test_up_hands_its_engine_flags_to_every_node() -> None:
    """--dtype bfloat16 (the suite pins `auto` to float32), --block-size and --max-model-len
    reach the prefill node and the decode node: their ModelInfo says so."""
    flags = ["--dtype", "bfloat16", "--block-size", "32", "--max-model-len", "256"]
    up = subprocess.Popen(
        pdserve("up", "--model", "tiny", "--port", "0", "--http-port", "0", *flags),
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        assert up.stdout is not None
        endpoint = next(
            (line.split()[1] for line in up.stdout if line.startswith("endpoint: ")), None
        )
        assert endpoint is not None, f"pdserve up exited with {up.wait()}"
        # each node's command line: python -m pdserve.cli ROLE ...
        argv = next(a for a in map(_cmdline, _children(up.pid)) if a[3] == "decode")
        prefill_target = argv[argv.index("--prefill") + 1]

        async def infos() -> list[object]:
            return [
                await get_model_info(endpoint),
                await get_model_info(prefill_target, service="prefill"),
            ]

        for info in asyncio.run(infos()):
            assert info.kv_layout.dtype == "bfloat16", info  # type: ignore[attr-defined]
            assert info.block_size == 32, info  # type: ignore[attr-defined]
            assert info.max_context == 256, info  # type: ignore[attr-defined]
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            assert up.wait(60) == 0
        finally:
            if up.poll() is None:
                up.kill()
                up.wait()
