"""SIGTERM to a real decode process with requests in its admission queue: the queued ones are
answered UNAVAILABLE at once (they never started; another node can serve them), the admitted
one finishes or is cut off with a clear status, and the process exits 0 (every seat and block
conserved)."""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request

import grpc
import pytest

from pdserve.client import generate
from pdserve.cluster import NodeProcess, spawn, stop_all, wait_ready
from shared.serving.metrics import parse_prometheus_text

MODEL = "tiny"


def metrics(node: NodeProcess) -> dict[str, float]:
    url = f"http://127.0.0.1:{node.info['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return parse_prometheus_text(resp.read().decode())


async def wait_metric(node: NodeProcess, name: str, at_least: float) -> None:
    deadline = time.monotonic() + 60
    while (await asyncio.to_thread(metrics, node)).get(name, 0.0) < at_least:
        assert time.monotonic() < deadline, f"{name} never reached {at_least}"
        await asyncio.sleep(0.05)


def test_sigterm_answers_queued_requests_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the nodes inherit it: see engine_helpers
    nodes: list[NodeProcess] = []
    try:
        p = spawn("prefill", ["--model", MODEL, "--port", "0"], echo=False)
        nodes.append(p)
        wait_ready([p], 120)
        target_p = f"127.0.0.1:{p.info['port']}"
        args = ["--model", MODEL, "--port", "0", "--prefill", target_p, "--max-inflight", "1"]
        args += ["--local-prefill-tokens", "0"]  # every request through the admission queue
        # the admitted request (3,000 tokens: still generating when the SIGTERM comes, on any
        # machine) is cut off after 1 s of drain instead of being waited out
        args += ["--drain-grace", "1"]
        d = spawn("decode", args, echo=False)
        nodes.append(d)
        wait_ready([d], 120)
        target = f"127.0.0.1:{d.info['port']}"

        async def body() -> list[object]:
            long = asyncio.ensure_future(
                generate(target, list(range(3, 40)), max_tokens=3000, ignore_eos=True, timeout=60)
            )
            await wait_metric(d, 'pdserve_requests{state="GENERATION_IN_PROGRESS"}', 1)
            queued = [
                asyncio.ensure_future(generate(target, [5, 6, 7 + i], max_tokens=4, timeout=60))
                for i in range(3)
            ]
            await wait_metric(d, 'pdserve_requests{state="QUEUED"}', 3)
            d.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(long, *queued, return_exceptions=True)

        long, *queued = asyncio.run(body())
        for r in queued:
            assert isinstance(r, grpc.aio.AioRpcError), r
            assert r.code() == grpc.StatusCode.UNAVAILABLE
            assert "still queued" in r.details()
        if isinstance(long, grpc.aio.AioRpcError):  # cut off at the end of the grace period
            assert long.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        else:
            assert len(long.token_ids) == 3000
        assert d.proc.wait(30) == 0  # 0: seats and blocks all conserved at exit
        m = metrics(p)
        assert m["pdserve_seats_in_use"] == 0 and m["pdserve_kv_blocks_pinned"] == 0
    finally:
        stop_all(nodes, grace=10)
