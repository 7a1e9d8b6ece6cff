"""`pdserve up` keeps its cluster serving: a node killed under load is started again on its ports
and used again, clients see whole streams or an error event then [DONE], and `up` gives up, in
one line, only once a node has exhausted its restarts. Real processes, real HTTP."""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import grpc
import httpx

from pdserve.client import generate
from pdserve.cluster import Cluster, popen_node, spawn, stop_all, wait_ready
from pdserve.supervisor import RestartPolicy, Supervisor
from tests.net_probe import listening_sockets
from tests.up_process import flag, metrics, start_up

LONG_PROMPT = 2100  # past the decode node's local-prefill bounds: a prefill node's job
CLIENTS = 4


async def _stream(client: httpx.AsyncClient, url: str, seed: int) -> str:
    """One streamed completion: "complete", "error" (an error event, then [DONE]) or
    "refused" (a JSON error before the stream); anything else fails the test."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 256) for _ in range(LONG_PROMPT)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode()
            assert resp.status_code != 500 and "error" in json.loads(text), text
            return "refused"
        events = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"stream cut: {events[-3:]}"
    last = json.loads(events[-2]) if len(events) > 1 else {}
    if "error" in last:
        return "error"
    assert last["choices"][0]["finish_reason"], f"stream ended without a finish: {events[-3:]}"
    return "complete"


async def _load(url: str, stop: asyncio.Event, outcomes: list[tuple[float, str]]) -> None:
    async def client_loop(client: httpx.AsyncClient, c: int) -> None:
        for i in range(1000):
            if stop.is_set():
                return
            started = time.monotonic()
            outcomes.append((started, await _stream(client, url, c * 1000 + i)))

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(client_loop(client, c) for c in range(CLIENTS)))


async def _until(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):  # type: ignore[arg-type]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)


def test_killed_prefill_node_is_restarted_and_used_while_streams_stay_whole(
    tmp_path: Path,
) -> None:
    up = start_up(tmp_path)
    try:
        [prefill] = up.nodes("prefill")
        port = flag(up.nodes("decode")[0], "--prefill").rsplit(":", 1)[1]
        outcomes: list[tuple[float, str]] = []

        async def body() -> tuple[float, int]:
            stop = asyncio.Event()
            load = asyncio.create_task(_load(up.http, stop, outcomes))
            await _until(lambda: len(outcomes) >= CLIENTS, 60, "no stream finished")
            killed = time.monotonic()
            os.kill(prefill, signal.SIGKILL)
            await asyncio.to_thread(up.wait_log, "prefill node restarted", 1, 30)
            await asyncio.to_thread(up.wait_log, "is back (restart 1)", 1, 90)
            back = time.monotonic()
            [again] = up.nodes("prefill")
            scrape = f"http://127.0.0.1:{flag(again, '--metrics-port')}"
            # the decode node routes long prompts to it again: KV pushed from the new process
            await _until(
                lambda: metrics(scrape)["pdserve_kv_transfer_bytes_total"] > 0,
                30,
                "the restarted prefill node was never used",
            )
            used = time.monotonic()
            stop.set()
            await load
            print(f"back {back - killed:.1f}s after the kill, used {used - back:.1f}s later")
            return killed, again

        killed, again = asyncio.run(body())
        assert again != prefill and flag(again, "--port") == port  # the same address
        scraped = metrics(f"http://127.0.0.1:{flag(again, '--metrics-port')}")
        assert scraped["pdserve_node_restarts_total"] == 1
        after = [o for t, o in outcomes if t > killed]
        print({o: after.count(o) for o in set(after)}, "after the kill, of", len(outcomes))
        assert after.count("complete") >= CLIENTS, f"the cluster stopped serving: {outcomes}"
        assert "exited with signal 9 (SIGKILL); restarting it in 0.5s" in up.log.read_text()
        assert up.stop() == 0, up.tail()
    finally:
        up.stop()


def test_killed_decode_node_comes_back_on_its_ports_then_up_gives_up(tmp_path: Path) -> None:
    up = start_up(tmp_path, "--max-restarts-per-minute", "1")
    try:
        [decode], [prefill] = up.nodes("decode"), up.nodes("prefill")
        # a local cluster listens on loopback only, UCX's own listeners included
        for pid in (decode, prefill):
            bound = listening_sockets(pid)
            assert bound and {ip for ip, _ in bound} == {"127.0.0.1"}, bound
        ports = {p for _, p in listening_sockets(decode)}
        os.kill(decode, signal.SIGKILL)
        up.wait_log("is back (restart 1)")
        [again] = up.nodes("decode")
        assert metrics(up.http)["pdserve_node_restarts_total"] == 1  # the same HTTP port
        assert asyncio.run(_one_stream(up.http)) == "complete"
        kept = {p for _, p in listening_sockets(again)}
        assert {int(flag(again, "--port")), int(flag(again, "--http-port"))} <= ports & kept
        os.kill(again, signal.SIGKILL)  # a second exit within the minute: past the limit of 1
        assert up.proc.wait(60) != 0, up.tail()
        log = up.log.read_text()
        why = [line for line in log.splitlines() if "giving up" in line]
        assert len(why) == 1 and "exited with signal 9 (SIGKILL)" in why[0], log[-3000:]
        assert not Path(f"/proc/{prefill}").exists(), "the other nodes stop with `up`"
    finally:
        up.stop()


async def _one_stream(url: str) -> str:
    async with httpx.AsyncClient(timeout=60) as client:
        return await _stream(client, url, 7)


def test_proxy_keeps_serving_while_up_restarts_a_killed_decode_node(tmp_path: Path) -> None:
    """`pdserve proxy` in front of `pdserve up --decode 2`: a decode node SIGKILLed under load
    costs the proxy's clients at most the streams that were on it (UNAVAILABLE, never a hang),
    and the proxy routes to the restarted node again."""
    up = start_up(tmp_path, "--decode", "2")
    first, second = up.nodes("decode")
    args = ["--backend", ",".join(up.decodes), "--port", "0", "--routing", "least-loaded"]
    proxy = spawn("proxy", [*args, "--health-interval", "1"], echo=False)
    try:
        wait_ready([proxy], 60)
        via = f"127.0.0.1:{proxy.info['port']}"
        outcomes: list[str] = []

        async def one(seed: int) -> None:
            try:
                await generate(via, [3 + seed % 200, 4, 5], max_tokens=24, timeout=60)
                outcomes.append("complete")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                outcomes.append("unavailable")

        async def body() -> None:
            await asyncio.gather(*(one(i) for i in range(4)))
            load = [asyncio.create_task(one(10 + i)) for i in range(6)]
            await asyncio.sleep(0.3)
            os.kill(first, signal.SIGKILL)
            await asyncio.gather(*load)
            await asyncio.gather(*(one(100 + i) for i in range(6)))  # new requests: served
            assert outcomes[-6:] == ["complete"] * 6, outcomes

        asyncio.run(body())
        up.wait_log("is back (restart 1)")
        [again] = set(up.nodes("decode")) - {second}
        scrape = f"http://127.0.0.1:{flag(again, '--metrics-port')}"

        async def until_used() -> None:
            deadline = time.monotonic() + 30
            while metrics(scrape)["pdserve_time_to_first_token_seconds_count"] < 1:
                assert time.monotonic() < deadline, "the proxy never used the restarted node"
                await asyncio.gather(*(one(200 + i) for i in range(4)))

        asyncio.run(until_used())
        assert up.stop() == 0, up.tail()
    finally:
        stop_all([proxy], grace=5)
        up.stop()


def test_a_node_that_refuses_to_start_is_not_restarted() -> None:
    """Exit 2 is a node refusing its command line (a port in use, a bad flag): starting it again
    would refuse again, so `up` stops at once with the reason instead of spending its budget."""
    cluster = Cluster("tiny", 1, 1, 0, [])
    refusing = popen_node("prefill", [sys.executable, "-c", "import sys; sys.exit(2)"], echo=False)
    cluster.nodes.append(refusing)
    try:
        why = Supervisor(cluster, RestartPolicy(max_per_minute=5), out=io.StringIO()).run(
            lambda: False, poll_s=0.05
        )
    finally:
        refusing.proc.wait(timeout=30)
        if refusing.lifeline is not None:
            refusing.lifeline.close()
    assert why is not None and "refused to start" in why and "status 2" in why
