"""Two hosts without Docker: a prefill node and a decode node in two network namespaces joined by
a veth pair, so the KV push crosses a real TCP stack between two addresses.

    [netns P] prefill 10.213.1.1:50061  <== veth ==>  [netns D] decode 10.213.1.2:50051
                                                                KV listener 10.213.1.2 (--ucx-host)

The nodes are real processes (`python -m pdserve.cli ...` under `ip netns exec`); the client runs
in netns P too, so requests, the prefill RPC and the KV bytes all cross the veth; every other
request goes through the gRPC proxy (`python -m pdserve.proxy`, also in netns P). Greedy outputs
must equal the colocated engine's, and the decode side's veth must have received at least as
many bytes as the decode node counts as KV transferred (UCX_TLS=tcp: no shared memory shortcut).
Skipped, with the reason, where network namespaces cannot be created (not root, no `ip`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pdserve.cluster import NodeProcess, popen_node, stop_all, wait_ready
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.engine_helpers import random_max_tokens, random_prompts

PREFILL_ADDR = "10.213.1.1"
DECODE_ADDR = "10.213.1.2"
PREFIX_LEN = 30  # /30: the two addresses and nothing else


@dataclass
class TwoHosts:
    prefill_ns: str
    decode_ns: str
    prefill_if: str
    decode_if: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _kill_namespace_processes(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:  # only processes this test started live in its own namespaces
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    if shutil.which("ip") is None:
        pytest.skip("network namespace test: the `ip` command (iproute2) is not installed")
    tag = f"{os.getpid() % 100000}"
    hosts = TwoHosts(f"pdserve-p{tag}", f"pdserve-d{tag}", f"pdvp{tag}", f"pdvd{tag}")
    first = _ip("netns", "add", hosts.prefill_ns, check=False)
    if first.returncode != 0:
        pytest.skip(
            "network namespace test: `ip netns add` is not permitted here "
            f"({first.stderr.strip() or 'exit ' + str(first.returncode)}); needs root/CAP_SYS_ADMIN"
        )
    created = [hosts.prefill_ns]
    try:
        _ip("netns", "add", hosts.decode_ns)
        created.append(hosts.decode_ns)
        _ip("link", "add", hosts.prefill_if, "type", "veth", "peer", "name", hosts.decode_if)
        for ns, dev, addr in (
            (hosts.prefill_ns, hosts.prefill_if, PREFILL_ADDR),
            (hosts.decode_ns, hosts.decode_if, DECODE_ADDR),
        ):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns in created:
            _kill_namespace_processes(ns)
            _ip("netns", "del", ns, check=False)  # takes the veth pair with it
        # a veth end left in the root namespace by a failure half-way
        _ip("link", "del", hosts.prefill_if, check=False)


def _node_env() -> dict[str, str]:
    env = os.environ.copy()
    # Both namespaces share this host's IPC namespace, so UCX would pick shared memory if it may:
    # tcp only makes the KV bytes cross the veth.
    env["UCX_TLS"] = "tcp"
    env["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    return env


def _spawn_in(ns: str, role: str, args: list[str]) -> NodeProcess:
    entry = ["pdserve.proxy"] if role == "proxy" else ["pdserve.cli", role]
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", *entry, *args]
    return popen_node(role, cmd, echo=False, env=_node_env())  # with a lifeline


# Runs inside the prefill namespace: the requests, alternately straight to the decode node and
# through the proxy, then the decode node's KV byte counter.
CLIENT = r"""
import asyncio, json, sys, urllib.request
from pdserve.client import generate
job = json.load(sys.stdin)
async def main():
    out = []
    for i, (prompt, max_tokens) in enumerate(zip(job["prompts"], job["max_tokens"])):
        target = job["targets"][i % len(job["targets"])]
        r = await generate(target, prompt, max_tokens=max_tokens, timeout=60)
        out.append(r.token_ids)
    return out
tokens = asyncio.run(main())
metrics = urllib.request.urlopen(job["metrics"], timeout=10).read().decode()
kv = [l for l in metrics.splitlines() if l.startswith("pdserve_kv_transfer_bytes_total ")]
print(json.dumps({"tokens": tokens, "kv_bytes": float(kv[0].split()[1])}))
"""


def _rx_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes"],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    return int(out.stdout)


def test_kv_crosses_a_veth_between_two_namespaces_and_greedy_matches() -> None:
    prompts = random_prompts(4, 250, min_len=40, max_len=160, seed=61)
    max_tokens = random_max_tokens(4, lo=4, hi=16, seed=62)
    colocated = LLM(EngineConfig(model="tiny", num_kv_blocks=1024), load_model("tiny"))
    want = [
        o.token_ids
        for o in colocated.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    ]
    with two_hosts() as hosts:
        nodes: list[NodeProcess] = []
        exit_code = 0
        try:
            prefill = _spawn_in(
                hosts.prefill_ns,
                "prefill",
                ["--model", "tiny", "--host", PREFILL_ADDR, "--port", "50061"],
            )
            nodes.append(prefill)
            wait_ready([prefill], timeout=60)
            decode = _spawn_in(
                hosts.decode_ns,
                "decode",
                [
                    "--model",
                    "tiny",
                    "--prefill",
                    f"{PREFILL_ADDR}:50061",
                    "--host",
                    DECODE_ADDR,
                    "--port",
                    "50051",
                    "--ucx-host",
                    DECODE_ADDR,
                    "--metrics-port",
                    "9100",
                    # every prompt crosses the veth: none is short enough to stay local
                    "--local-prefill-tokens",
                    "0",
                ],
            )
            nodes.append(decode)
            wait_ready([decode], timeout=60)
            assert str(decode.info["ucx_address"]).startswith(DECODE_ADDR + ":")
            # the public gRPC proxy (pdserve/proxy.py) on the prefill host, in front of decode
            proxy = _spawn_in(
                hosts.prefill_ns,
                "proxy",
                ["--backend", f"{DECODE_ADDR}:50051", "--port", "50052"],
            )
            nodes.append(proxy)
            wait_ready([proxy], timeout=60)

            rx_before = _rx_bytes(hosts.decode_ns, hosts.decode_if)
            job = {
                "targets": [f"{DECODE_ADDR}:50051", "127.0.0.1:50052"],
                "prompts": prompts,
                "max_tokens": max_tokens,
                "metrics": f"http://{DECODE_ADDR}:9100/metrics",
            }
            client = subprocess.run(
                ["ip", "netns", "exec", hosts.prefill_ns, sys.executable, "-c", CLIENT],
                input=json.dumps(job),
                capture_output=True,
                text=True,
                timeout=120,
                env=_node_env(),
            )
            assert client.returncode == 0, client.stderr
            result = json.loads(client.stdout.strip().splitlines()[-1])
            rx = _rx_bytes(hosts.decode_ns, hosts.decode_if) - rx_before

            for i, got in enumerate(result["tokens"]):
                assert got == want[i], f"request {i}: differs from the colocated engine"
            kv_bytes = result["kv_bytes"]
            assert kv_bytes > 0, "no KV was transferred"
            assert rx >= kv_bytes, (
                f"the decode namespace's veth received {rx} bytes, less than the {kv_bytes:.0f} "
                "KV bytes the decode node counted: KV did not cross the veth"
            )
        finally:
            exit_code = stop_all(nodes, grace=20)
        assert exit_code == 0, "a node exited non-zero (failed conservation at shutdown?)"
