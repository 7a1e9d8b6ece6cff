"""A prefill node restarted on its address is routed to again within two health-check intervals
of reporting ready, however long it was away (real processes, real gRPC)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from pdserve.client import generate
from pdserve.cluster import NodeProcess, spawn, stop_all, wait_ready

INTERVAL_S = 1.0
# gRPC's default exponential redial (1 s growing 1.6x, +-20% jitter) dials about 16 s and
# 26 s after the kill. Away 15.5 s plus its start (2-4 s), the node is back just after the
# first of those, so without reconnect_options it would be used ~8 s after it is ready (measured
# 7.3 s and 7.9 s; 5.4 s with 18 s away, which lands later in the same gap).
AWAY_S = 15.5
SLACK_S = 3.0  # a loaded two-core machine: scheduling, the first prefill's own time


@pytest.fixture
def started() -> Iterator[list[NodeProcess]]:
    nodes: list[NodeProcess] = []
    yield nodes
    stop_all(nodes, grace=10)


def _prefill(nodes: list[NodeProcess], port: int = 0) -> NodeProcess:
    node = spawn("prefill", ["--model", "tiny", "--port", str(port)], echo=False)
    nodes.append(node)
    wait_ready([node], 120)
    return node


async def _served(target: str) -> bool:
    """Whether a prompt is served; with local prefill off, only a prefill node can serve it."""
    try:
        await generate(target, [5, 6, 7, 8], max_tokens=2, timeout=30)
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        return False
    return True


def test_restarted_prefill_node_is_used_within_two_health_intervals(
    started: list[NodeProcess],
) -> None:
    prefill = _prefill(started)
    port = int(prefill.info["port"])
    args = ["--model", "tiny", "--port", "0", "--http-port", "-1", "--prefill", f"127.0.0.1:{port}"]
    args += ["--health-check-interval", str(INTERVAL_S), "--local-prefill-tokens", "0"]
    args += ["--local-prefill-idle-tokens", "0", "--no-local-prefill-fallback"]
    decode = spawn("decode", args, echo=False)
    started.append(decode)
    wait_ready([decode], 120)
    target = f"127.0.0.1:{decode.info['port']}"
    assert asyncio.run(_served(target))

    prefill.proc.kill()
    prefill.proc.wait(10)
    assert not asyncio.run(_served(target))  # nobody prefills: refused, not hung
    time.sleep(AWAY_S)
    _prefill(started, port)  # back on the same address
    ready = time.monotonic()

    async def until_served() -> float:
        while not await _served(target):
            assert time.monotonic() - ready < 60, "restarted prefill node never used again"
            await asyncio.sleep(0.1)
        return time.monotonic() - ready

    took = asyncio.run(until_served())
    print(f"re-admitted and used {took:.2f}s after it reported ready")
    assert took <= 2 * INTERVAL_S + SLACK_S, f"used again only {took:.1f}s after it was ready"
