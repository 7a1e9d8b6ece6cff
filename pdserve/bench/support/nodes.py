"""Node processes for the TTFT and serving benchmarks: real `pdserve prefill/decode/colocated`
nodes, each pinned with `taskset` to its own core and limited to one torch
thread, so that P/D and colocated get the same compute per role."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.support.util import child_env, idle_cpu_percent
from pdserve.cluster import NodeProcess, stop_all, wait_ready

READY_TIMEOUT_S = 180.0


def cpu_ids() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def core(i: int) -> str:
    """The i-th CPU this process may use (wrapping), as a taskset list."""
    cpus = cpu_ids()
    return str(cpus[i % len(cpus)])


@dataclass
class NodeSpec:
    name: str  # unique in a setup: "prefill", "decode", "decode-whole", "colocated"
    module: str  # "pdserve.cli"
    args: list[str]
    cpus: str | None  # taskset list; None: unpinned
    threads: int = 1


@dataclass
class RunningNodes:
    nodes: dict[str, NodeProcess] = field(default_factory=dict)

    def port(self, name: str) -> int:
        return int(self.nodes[name].info["port"])

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.port(name)}"

    def http_url(self, name: str) -> str:
        """The node's OpenAI-compatible HTTP API (decode nodes)."""
        return f"http://127.0.0.1:{self.nodes[name].info['http_port']}"

    def metrics_url(self, name: str) -> str:
        """The node's Prometheus /metrics (every node serves one; --metrics-port 0 default)."""
        return f"http://127.0.0.1:{self.nodes[name].info['metrics_port']}/metrics"

    def idle_cpu(self, seconds: float) -> dict[str, float]:
        """Percent of a core each node uses while no request is in flight."""
        pids = {name: node.proc.pid for name, node in self.nodes.items()}
        used = idle_cpu_percent(list(pids.values()), seconds)
        return {name: used[pid] for name, pid in pids.items()}


def spawn(spec: NodeSpec, log_dir: Path) -> NodeProcess:
    cmd = [sys.executable, "-m", spec.module, *spec.args]
    if spec.cpus is not None:
        cmd = ["taskset", "-c", spec.cpus, *cmd]
    threads = str(spec.threads)
    env = child_env(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{spec.name}.log", "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True
        )
    node = NodeProcess(spec.name, proc)
    threading.Thread(target=node.pump, args=(False,), daemon=True).start()
    return node


@contextlib.contextmanager
def running(specs: list[NodeSpec], log_dir: Path) -> Iterator[RunningNodes]:
    """Start nodes in order (a spec's args may name an earlier node's port as
    '{port:NAME}'), wait until each is ready, always stop them all. Nodes that name no port of
    a node not yet ready start together (a cluster's prefill nodes), each on its own cores."""
    nodes = RunningNodes()
    try:
        for wave in _waves(specs):
            started = []
            for spec in wave:
                args = [_resolve(arg, nodes) for arg in spec.args]
                spec_now = NodeSpec(spec.name, spec.module, args, spec.cpus, spec.threads)
                nodes.nodes[spec.name] = spawn(spec_now, log_dir)
                started.append(nodes.nodes[spec.name])
            wait_ready(started, READY_TIMEOUT_S)
        yield nodes
    finally:
        stop_all(list(nodes.nodes.values()), grace=15.0)


def _waves(specs: list[NodeSpec]) -> list[list[NodeSpec]]:
    """`specs` in order, cut before each spec that names the port of one in the current wave."""
    waves: list[list[NodeSpec]] = [[]]
    for spec in specs:
        names = {s.name for s in waves[-1]}
        if any(f"{{port:{name}}}" in arg for arg in spec.args for name in names):
            waves.append([])
        waves[-1].append(spec)
    return [wave for wave in waves if wave]


def _resolve(arg: str, nodes: RunningNodes) -> str:
    """'{port:NAME}' -> 127.0.0.1:PORT, also inside a comma list (several prefill nodes)."""
    if "{port:" not in arg:
        return arg
    parts = arg.split(",")
    for i, part in enumerate(parts):
        if part.startswith("{port:") and part.endswith("}"):
            parts[i] = f"127.0.0.1:{nodes.port(part[6:-1])}"
    return ",".join(parts)


def engine_args(model: str, extra: dict[str, Any] | None = None) -> list[str]:
    args = ["--model", model, "--device", "cpu", "--log-level", "warning"]
    for key, value in (extra or {}).items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def pd_specs(
    model: str,
    engine: dict[str, Any] | None = None,
    whole_too: bool = False,
    decode_extra: Sequence[str] = (),
) -> list[NodeSpec]:
    """1 prefill node on core 0, its decode node on core 1 with the default push (auto: whole,
    both nodes being on this host). With whole_too (bench ttft, which compares the pushes), that
    decode node asks for layer-wise pushes and a second one on core 1 for whole-request pushes
    from the same prefill node. `decode_extra`: more flags for the decode node(s)."""
    base = engine_args(model, engine)
    decode = ["decode", *base, "--port", "0", "--http-port", "0", "--prefill", "{port:prefill}"]
    decode += decode_extra
    specs = [
        NodeSpec("prefill", "pdserve.cli", ["prefill", *base, "--port", "0"], core(0)),
        NodeSpec(
            "decode",
            "pdserve.cli",
            [*decode, "--push", "layerwise"] if whole_too else decode,
            core(1),
        ),
    ]
    if whole_too:
        specs.append(NodeSpec("decode-whole", "pdserve.cli", [*decode, "--push", "whole"], core(1)))
    return specs


def colocated_spec(
    model: str, engine: dict[str, Any] | None = None, cpus: str | None = None, threads: int = 1
) -> NodeSpec:
    """`pdserve colocated`: a decode node with no prefill nodes, every prompt prefilled by its
    own engine (the same front door, admission and gRPC stack as the P/D cluster's)."""
    args = ["colocated", *engine_args(model, engine), "--port", "0", "--http-port", "0"]
    return NodeSpec("colocated", "pdserve.cli", args, cpus or core(0), threads)
