"""The image's entry point and health check without building the image: every server role of the
`pdserve` command is routed (with the container defaults added, parsed by the CLI's own parser),
and a colocated node started through the entry point is found on its port and reported healthy
by the health check, over the real gRPC health protocol."""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from pdserve.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "docker" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


entrypoint = _load("entrypoint")
healthcheck = _load("healthcheck")


def _server_commands() -> set[str]:
    """The `pdserve` subcommands that start one server listening on --host/--port."""
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    servers = set()
    for name, p in sub.choices.items():
        flags = {s for a in p._actions for s in a.option_strings}
        if {"--host", "--port"} <= flags:
            servers.add(name)
    return servers


def test_every_server_role_is_an_entrypoint_role() -> None:
    servers = _server_commands()
    assert {"prefill", "decode", "colocated", "proxy"} <= servers
    assert servers == set(entrypoint.ROLES)
    assert set(entrypoint.ROLES) <= set(healthcheck.DEFAULT_PORTS)


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated", "proxy"])
def test_role_routing_parses(role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_UCX_HOST", "10.0.0.7")
    args = {
        "decode": ["--prefill", "prefill:50061"],
        "proxy": ["--backend", "decode:50051"],
    }.get(role, [])
    command = entrypoint.node_command(role, args)
    tail = command[3:] if role == "proxy" else command[2:]
    a = build_parser().parse_args([role, *tail])
    assert a.host == "0.0.0.0"
    assert a.metrics_port == 9100
    # only a decode node has prefill nodes to push it KV: only it places its KV listener
    # (a prefill node places one for its encoders' pushes: below)
    assert ("--ucx-host" in command) == (role == "decode")
    if role == "decode":
        assert a.ucx_host == "10.0.0.7"
    # the health check finds the node's default port from the command the entry point runs
    assert healthcheck.node_port(command) == healthcheck.DEFAULT_PORTS[role]
    assert healthcheck.node_port([*command, "--port", "6001"]) == 6001


def test_a_prefill_node_with_encoders_places_its_landing_listener(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its encoders push embeddings to it over UCX: its listener gets the container's address
    (on the network that leads to them), as a decode node's does for KV."""
    monkeypatch.setenv("PDSERVE_UCX_HOST", "10.0.0.8")
    command = entrypoint.node_command("prefill", ["--encoder", "encode:50071"])
    a = build_parser().parse_args(["prefill", *command[2:]])
    assert a.ucx_host == "10.0.0.8" and a.encoder == "encode:50071"


def test_an_unknown_first_word_runs_as_given() -> None:
    assert healthcheck.node_port(["pdserve", "generate", "hi"]) is None
    assert "generate" not in entrypoint.ROLES


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_colocated_container_command_reports_healthy() -> None:
    """`<image> colocated ...` as the image runs it: entrypoint.py exec()s the node (same pid),
    the health check reads the port from that pid's command line and asks it."""
    port = _free_port()
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(PDSERVE_HOST="127.0.0.1", PDSERVE_METRICS_PORT="-1")
    cmd = [sys.executable, str(ROOT / "docker" / "entrypoint.py"), "colocated"]
    cmd += ["--model", "tiny", "--port", str(port), "--http-port", "-1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = any(line.startswith("PDSERVE_READY ") for line in proc.stdout)
        assert ready, f"the colocated node exited with {proc.wait()}"
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode().split("\0")
        assert "colocated" in argv
        assert healthcheck.node_port(argv[1:]) == port
        check = [sys.executable, str(ROOT / "docker" / "healthcheck.py")]
        health_env = {**env, "PDSERVE_HEALTH_TARGET": f"127.0.0.1:{port}"}
        deadline = time.monotonic() + 30
        while True:
            done = subprocess.run(check, env=health_env, capture_output=True, text=True, timeout=30)
            if done.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert done.returncode == 0, done.stderr
        assert "SERVING" in done.stdout
    finally:
        proc.terminate()
        proc.wait(30)
