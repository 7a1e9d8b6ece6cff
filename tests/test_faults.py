"""Faults injected into real processes: stalls, kills, decode death, SIGTERM.

After each scenario the surviving nodes serve a fresh batch with correct greedy output and
/metrics shows zero seats and zero pinned blocks on every live node.
"""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from pdserve.client import generate
from pdserve.cluster import NodeProcess, spawn, stop_all, wait_ready
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.serving.metrics import parse_prometheus_text
from tests.engine_helpers import random_prompts
from tests.net_probe import listening_sockets, tcp_connects

MODEL = "tiny"
VOCAB = 256  # byte tokens only: keep clear of the tiny model's special ids
SLOW_PREFILL = ["--max-num-tokens", "64"]  # many chunks: a long prompt takes a while


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(EngineConfig(model=MODEL, num_kv_blocks=1024))


class Nodes:
    def __init__(self) -> None:
        self.all: list[NodeProcess] = []

    def prefill(self, *extra: str, port: int = 0) -> NodeProcess:
        node = spawn("prefill", ["--model", MODEL, "--port", str(port), *extra], echo=False)
        self.all.append(node)
        wait_ready([node], 120)
        return node

    def decode(self, prefills: list[NodeProcess], *extra: str) -> NodeProcess:
        targets = ",".join(f"127.0.0.1:{p.info['port']}" for p in prefills)
        args = [
            "--model",
            MODEL,
            "--port",
            "0",
            "--prefill",
            targets,
            "--health-check-interval",
            "0.5",
            "--http-port",
            "0",
            # the P/D path under test: every prompt goes to a prefill node
            "--local-prefill-tokens",
            "0",
            "--no-local-prefill-fallback",
            *extra,
        ]
        node = spawn("decode", args, echo=False)
        self.all.append(node)
        wait_ready([node], 120)
        return node

    def colocated(self, *extra: str) -> NodeProcess:
        """`pdserve colocated`: the same public contract, no prefill nodes."""
        args = ["--model", MODEL, "--port", "0", "--http-port", "0", *extra]
        node = spawn("colocated", args, echo=False)
        self.all.append(node)
        wait_ready([node], 120)
        return node


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    n = Nodes()
    yield n
    for node in n.all:
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGCONT)
    stop_all(n.all, grace=10)


def target(node: NodeProcess) -> str:
    return f"127.0.0.1:{node.info['port']}"


def metrics(node: NodeProcess) -> dict[str, float]:
    url = f"http://127.0.0.1:{node.info['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return parse_prometheus_text(resp.read().decode())


def wait_released(*live: NodeProcess, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        held = {
            n.role + str(n.proc.pid): (
                m["pdserve_seats_in_use"],
                m["pdserve_kv_blocks_pinned"],
                m["pdserve_kv_blocks_in_use"],
                # decode nodes: no KV write still posted into a finished transfer's blocks
                m.get("pdserve_kv_writes_in_flight", 0.0),
                m.get("pdserve_kv_fenced_transfers", 0.0),
            )
            for n in live
            for m in [metrics(n)]
        }
        if all(v == (0, 0, 0, 0, 0) for v in held.values()):
            return
        assert time.monotonic() < deadline, f"resources still held: {held}"
        time.sleep(0.1)


async def until_busy(node: NodeProcess, timeout: float = 30.0) -> None:
    """Returns once `node` has a request in its engine (a seat taken)."""
    deadline = time.monotonic() + timeout
    while (await asyncio.to_thread(metrics, node))["pdserve_seats_in_use"] < 1:
        assert time.monotonic() < deadline, "the prefill node never took a request"
        await asyncio.sleep(0.005)


def check_fresh_batch(decode: NodeProcess, reference: LLM, seed: int) -> None:
    prompts = random_prompts(4, VOCAB, min_len=5, max_len=200, seed=seed)
    want = [o.token_ids for o in reference.generate(prompts, SamplingParams(max_tokens=8))]

    async def body() -> list[object]:
        return await asyncio.gather(
            *(generate(target(decode), p, max_tokens=8, timeout=60) for p in prompts)
        )

    got = asyncio.run(body())
    assert [g.token_ids for g in got] == want


def test_stalled_prefill_is_skipped_and_requests_retry(nodes: Nodes, reference: LLM) -> None:
    a, b = nodes.prefill(), nodes.prefill()
    d = nodes.decode([a, b], "--kv-transfer-timeout", "2")
    check_fresh_batch(d, reference, seed=1)  # both prefill nodes warm
    a.proc.send_signal(signal.SIGSTOP)
    prompts = random_prompts(6, VOCAB, min_len=5, max_len=100, seed=2)
    want = [o.token_ids for o in reference.generate(prompts, SamplingParams(max_tokens=6))]

    async def body() -> list[object]:
        return await asyncio.gather(
            *(generate(target(d), p, max_tokens=6, timeout=60) for p in prompts)
        )

    got = asyncio.run(body())
    assert [g.token_ids for g in got] == want  # the stalled node's share retried on b
    peer_a = f'pdserve_prefill_peer_healthy{{peer="{target(a)}"}}'
    assert metrics(d)[peer_a] == 0
    a.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 10
    while metrics(d)[peer_a] != 1:
        assert time.monotonic() < deadline, "resumed prefill node never became healthy again"
        time.sleep(0.2)
    check_fresh_batch(d, reference, seed=3)
    wait_released(a, b, d)


def test_killed_prefill_mid_transfer_then_all_dead_then_restart(
    nodes: Nodes, reference: LLM
) -> None:
    a = nodes.prefill(*SLOW_PREFILL)
    b = nodes.prefill(*SLOW_PREFILL)
    d = nodes.decode([a, b])
    check_fresh_batch(d, reference, seed=4)
    prompts = random_prompts(4, VOCAB, min_len=1500, max_len=2000, seed=5)
    want = [o.token_ids for o in reference.generate(prompts, SamplingParams(max_tokens=4))]

    async def body() -> list[object]:
        tasks = [
            asyncio.ensure_future(generate(target(d), p, max_tokens=4, timeout=60)) for p in prompts
        ]
        await asyncio.sleep(0.15)  # both prefill nodes are busy with long prompts
        a.proc.kill()
        return await asyncio.gather(*tasks)

    got = asyncio.run(body())
    assert [g.token_ids for g in got] == want
    b.proc.kill()

    async def no_prefill() -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(target(d), [5, 6, 7], max_tokens=2, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "prefill" in err.value.details()

    asyncio.run(no_prefill())
    wait_released(d)
    nodes.prefill(port=int(b.info["port"]))  # a replacement on the same address
    deadline = time.monotonic() + 15
    while True:
        try:
            check_fresh_batch(d, reference, seed=6)
            break
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() < deadline, "restarted prefill node never served"
            time.sleep(0.5)
    wait_released(d)


def test_decode_death_releases_prefill_side(nodes: Nodes, reference: LLM) -> None:
    p = nodes.prefill(*SLOW_PREFILL)
    d = nodes.decode([p])
    prompts = random_prompts(3, VOCAB, min_len=1500, max_len=2000, seed=7)

    async def body() -> None:
        tasks = [
            asyncio.ensure_future(generate(target(d), q, max_tokens=50, timeout=60))
            for q in prompts
        ]
        # kill while the prefill node holds a request: a fixed sleep let the first request
        # finish on a fast machine (prefill + 50 decode steps take ~0.2 s on the tiny model)
        await until_busy(p)
        d.proc.kill()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, grpc.aio.AioRpcError) for r in results)

    asyncio.run(body())
    wait_released(p)
    d2 = nodes.decode([p])
    check_fresh_batch(d2, reference, seed=8)
    wait_released(p, d2)


@pytest.mark.parametrize("colocated", [False, True], ids=["pd", "colocated"])
def test_sigterm_drains_in_flight_work_and_exits_clean(
    colocated: bool, nodes: Nodes, reference: LLM
) -> None:
    prefills = [] if colocated else [nodes.prefill()]
    d = nodes.colocated() if colocated else nodes.decode(prefills)
    prompts = random_prompts(3, VOCAB, min_len=10, max_len=100, seed=9)
    want = [o.token_ids for o in reference.generate(prompts, SamplingParams(max_tokens=40))]

    async def body() -> list[object]:
        tasks = [
            asyncio.ensure_future(generate(target(d), q, max_tokens=40, timeout=60))
            for q in prompts
        ]
        await asyncio.sleep(0.3)
        d.proc.send_signal(signal.SIGTERM)
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(body())
    for r, w in zip(results, want, strict=True):
        # finished within the grace period, or aborted with a clear status: never hung
        if isinstance(r, grpc.aio.AioRpcError):
            assert r.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        else:
            assert r.token_ids == w
    assert d.proc.wait(30) == 0  # 0 = seats and blocks all conserved at exit
    wait_released(*prefills)


def test_decode_node_listens_only_on_its_configured_address(nodes: Nodes, reference: LLM) -> None:
    """--host and --ucx-host 127.0.0.1: the gRPC port, /metrics, the KV listener and UCX's own
    tcp sockets are all bound to 127.0.0.1, so another address of the host (127.0.0.2 here,
    a second interface in a real deployment) reaches none of them; KV still flows."""
    p = nodes.prefill()
    d = nodes.decode([p], "--ucx-host", "127.0.0.1")
    check_fresh_batch(d, reference, seed=21)
    sockets = listening_sockets(d.proc.pid)
    kv_port = int(d.info["ucx_address"].rsplit(":", 1)[1])
    ports = {port for _, port in sockets}
    assert {d.info["port"], d.info["metrics_port"], kv_port} <= ports
    assert len(sockets) >= 4, sockets  # and at least one socket of UCX's tcp transport
    assert {ip for ip, _ in sockets} == {"127.0.0.1"}, sockets
    assert tcp_connects("127.0.0.1", kv_port) and not tcp_connects("127.0.0.2", kv_port)
    wait_released(p, d)
