"""`pdserve up`: a local cluster of separate node processes (fresh interpreters, never forked:
UCX does not survive a fork)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.lifeline import Lifeline
from pdserve.restart_count import restart_env
from pdserve.stderr_mux import StderrRelay
from shared.engine.runtime.cpu_budget import SHARED_BY_ENV


@dataclass
class NodeProcess:
    role: str
    proc: subprocess.Popen[str]
    ready: threading.Event = field(default_factory=threading.Event)
    info: dict[str, object] = field(default_factory=dict)
    lifeline: Lifeline | None = None

    def pump(self, echo: bool) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("PDSERVE_READY "):
                self.info = json.loads(line.split(" ", 1)[1])
                self.ready.set()
            elif echo:  # to stderr: a node's own output (UCX logs to stdout) is not ours
                sys.stderr.write(line)
        self.ready.set()  # EOF: the process died; `wait_ready` tells the difference


def popen_node(
    role: str,
    cmd: list[str],
    echo: bool = True,
    env: dict[str, str] | None = None,
    stderr: int | None = None,
    **kw: Any,
) -> NodeProcess:
    """Start a node process tied to this one by a lifeline (see pdserve/lifeline.py): it drains
    and exits on its own once this process dies, however that happens. Its own session keeps a
    terminal's Ctrl-C away from it: `pdserve up` stops the nodes in order instead. `stderr`: a
    file descriptor for its stderr (None: this process's)."""
    lifeline = Lifeline()
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=lifeline.env(env),
            pass_fds=lifeline.pass_fds,
            start_new_session=True,
            **kw,
        )
    except BaseException:
        lifeline.close()
        raise
    lifeline.opened()
    node = NodeProcess(role, proc, lifeline=lifeline)
    threading.Thread(target=node.pump, args=(echo,), daemon=True).start()
    return node


def spawn(
    role: str,
    args: list[str],
    echo: bool = True,
    env: dict[str, str] | None = None,
    stderr: int | None = None,
) -> NodeProcess:
    return popen_node(role, [sys.executable, "-m", "pdserve.cli", role, *args], echo, env, stderr)


_STOP_ORDER = {"proxy": 0, "decode": 1}
# The ports a node announces once ready, by the flag that asks for them.
_PORT_FLAGS = {"--port": "port", "--metrics-port": "metrics_port", "--http-port": "http_port"}


@dataclass(frozen=True)
class NodeSpec:
    """How one node of a cluster is started: what `pdserve up` starts again when it exits."""

    role: str
    args: tuple[str, ...]
    env: Mapping[str, str]
    echo: bool = True
    stderr: int | None = None  # its end of the cluster's stderr relay (None: this process's)

    def start(self, restarts: int = 0) -> NodeProcess:
        env = restart_env(self.env, restarts)
        return spawn(self.role, list(self.args), self.echo, env, self.stderr)

    def pinned(self, info: Mapping[str, object]) -> NodeSpec:
        """The same node on the ports it announced (where it asked for any, 0): its peers and
        clients know them. argparse takes the last of a repeated flag."""
        ports = [(flag, info.get(key)) for flag, key in _PORT_FLAGS.items()]
        return replace(self, args=(*self.args, *(a for f, p in ports if p for a in (f, str(p)))))


def shared_host_env(num_nodes: int) -> dict[str, str]:
    """The environment of nodes that share this host's cores: each sizes its threads to an
    equal share of the CPUs it may use, re-read when they change
    (shared/engine/runtime/cpu_budget.py),
    and its OpenMP workers sleep when idle instead of spinning. A spinning worker of one node
    holds a core another node needs; measured here (docs/performance.md, "Threads and memory"),
    that costs a loaded two-node host 10-16x per op. What the user set in the environment is
    kept (an OMP_NUM_THREADS fixes every node's count)."""
    env = dict(os.environ)
    env.setdefault(SHARED_BY_ENV, str(max(1, num_nodes)))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def wait_ready(nodes: list[NodeProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for node in nodes:
        if not node.ready.wait(max(0.0, deadline - time.monotonic())) or not node.info:
            code = node.proc.poll()
            raise RuntimeError(
                f"{node.role} node (pid {node.proc.pid}) did not become ready"
                + (f": exited with {code}" if code is not None else f" within {timeout:.0f}s")
            )


def stop_all(nodes: list[NodeProcess], grace: float = 15.0) -> int:
    """SIGTERM everyone, the front door first (the proxy, then decode nodes), then wait; kill
    stragglers."""
    for node in sorted(nodes, key=lambda n: _STOP_ORDER.get(n.role, len(_STOP_ORDER))):
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    worst = 0
    for node in nodes:
        try:
            code = node.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.proc.kill()
            code = node.proc.wait()
        if node.lifeline is not None:
            node.lifeline.close()
        worst = max(worst, abs(code))
    return worst


class Cluster:
    """`port`/`http_port`: the first decode node's (the next ones count up; 0: ephemeral; an
    http_port of -1: no HTTP API). With `front_door` and more than one decode node, a proxy
    (`pdserve proxy`: gRPC and, unless http_port is -1, HTTP) takes `port`/`http_port` in front
    of them all and the decode nodes the ports after. `extra` goes to every node,
    `prefill_extra` to prefill nodes only, `decode_extra` to decodes only."""

    def __init__(
        self,
        model: str,
        num_prefill: int,
        num_decode: int,
        port: int,
        extra: list[str],
        *,
        http_port: int = -1,
        decode_extra: list[str] | None = None,
        prefill_extra: list[str] | None = None,
        front_door: bool = False,
        num_encode: int = 0,
        encode_extra: list[str] | None = None,
    ):
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("a cluster needs at least one prefill and one decode node")
        self.model = model
        self.http_port = http_port
        self.decode_extra = list(decode_extra or [])
        self.prefill_extra = list(prefill_extra or [])
        self.num_prefill = num_prefill
        self.num_decode = num_decode
        # encoder nodes (E/P/D): started first, their targets given to every prefill node
        self.num_encode = num_encode
        self.encode_extra = list(encode_extra or [])
        self.front_door = front_door and num_decode > 1
        self.port = port
        self.extra = extra
        self.nodes: list[NodeProcess] = []
        self.specs: list[NodeSpec] = []  # how nodes[i] was started, on the ports it got
        self.relay: StderrRelay | None = None  # the nodes' stderr, one loading bar at a time

    def start(self, timeout: float = 120.0, echo: bool = True) -> list[str]:
        env = shared_host_env(self.num_encode + self.num_prefill + self.num_decode)
        # Every node is on this host: UCX's own tcp sockets (a prefill node's too, which has no
        # listener of its own) stay on loopback like the decode nodes' KV listeners, which bind
        # --ucx-host, 127.0.0.1 by default. An operator's UCX_NET_DEVICES wins.
        env.setdefault("UCX_NET_DEVICES", "lo")
        # each node's stderr through one relay: two nodes loading at once draw one bar at a time
        nodes = self.num_encode + self.num_prefill + self.num_decode + self.front_door
        self.relay = StderrRelay(nodes)
        fds = iter(self.relay.fds)
        prefill_args = ("--model", self.model, "--port", "0", *self.extra, *self.prefill_extra)
        if self.num_encode:
            encode_args = ("--model", self.model, "--port", "0", *self.encode_extra)
            specs = [
                NodeSpec("encode", encode_args, env, echo, next(fds))
                for _ in range(self.num_encode)
            ]
            encoders = self._start_nodes(specs, timeout)
            prefill_args += ("--encoder", ",".join(f"127.0.0.1:{e.info['port']}" for e in encoders))
        specs = [
            NodeSpec("prefill", prefill_args, env, echo, next(fds)) for _ in range(self.num_prefill)
        ]
        prefills = self._start_nodes(specs, timeout)
        targets = ",".join(f"127.0.0.1:{p.info['port']}" for p in prefills)
        specs = [
            self._decode_spec(i, targets, env, echo, next(fds)) for i in range(self.num_decode)
        ]
        decodes = self._start_nodes(specs, timeout)
        endpoints = [f"127.0.0.1:{d.info['port']}" for d in decodes]
        if self.front_door:
            self._start_nodes([self._proxy_spec(decodes, env, echo, next(fds))], timeout)
        return endpoints

    def _proxy_spec(
        self, decodes: list[NodeProcess], env: dict[str, str], echo: bool, stderr: int
    ) -> NodeSpec:
        """The front door: one gRPC (and HTTP) endpoint over every decode node, resuming a
        stream whose node dies on another (pdserve/proxy.py)."""
        grpc = ",".join(f"127.0.0.1:{d.info['port']}" for d in decodes)
        args = ("--backend", grpc, "--host", "127.0.0.1", "--port", str(self.port))
        args += ("--http-port", str(self.http_port), "--health-interval", "1")
        if self.http_port >= 0:
            http = ",".join(f"127.0.0.1:{d.info['http_port']}" for d in decodes)
            args += ("--backend-http", http)
        return NodeSpec("proxy", args, env, echo, stderr)

    @property
    def front_door_endpoint(self) -> str | None:
        """HOST:PORT of the front door's gRPC API (None: no front door)."""
        proxy = next((n for n in self.nodes if n.role == "proxy"), None)
        return None if proxy is None else f"127.0.0.1:{proxy.info['port']}"

    @property
    def front_door_http(self) -> str | None:
        """http://HOST:PORT of the front door's HTTP API (None: none)."""
        proxy = next((n for n in self.nodes if n.role == "proxy"), None)
        port = None if proxy is None else proxy.info.get("http_port")
        return f"http://127.0.0.1:{port}" if port else None

    def _decode_spec(
        self, i: int, targets: str, env: dict[str, str], echo: bool, stderr: int
    ) -> NodeSpec:
        i += self.front_door  # the front door takes the first ports
        port = self.port + i if self.port else 0
        http_port = self.http_port + i if self.http_port > 0 else self.http_port
        args = ("--model", self.model, "--port", str(port), "--prefill", targets)
        args += ("--http-port", str(http_port), *self.extra, *self.decode_extra)
        return NodeSpec("decode", args, env, echo, stderr)

    def _start_nodes(self, specs: list[NodeSpec], timeout: float) -> list[NodeProcess]:
        nodes = [spec.start() for spec in specs]
        self.nodes.extend(nodes)
        self.specs.extend(specs)
        wait_ready(nodes, timeout)
        first = len(self.specs) - len(specs)
        for i, node in enumerate(nodes, first):
            self.specs[i] = self.specs[i].pinned(node.info)
        return nodes

    def restart(self, index: int, restarts: int) -> NodeProcess:
        """Start node `index`, which has exited, again as first started and on the same ports;
        `restarts` (this one included) is exported on its /metrics."""
        old = self.nodes[index]
        if old.lifeline is not None:
            old.lifeline.close()
        self.nodes[index] = self.specs[index].start(restarts)
        return self.nodes[index]

    @property
    def http_endpoints(self) -> list[str]:
        """http://HOST:PORT of every decode node serving the HTTP API."""
        return [
            f"{d.info.get('http_scheme', 'http')}://127.0.0.1:{d.info['http_port']}"
            for d in self.nodes
            if d.role == "decode" and d.info.get("http_port")
        ]

    def stop(self) -> int:
        code = stop_all(self.nodes)
        if self.relay is not None:
            self.relay.close()  # once it has copied what the nodes wrote last
        return code
