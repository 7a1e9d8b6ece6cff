"""A bounded soak: mixed traffic, client cancels and a prefill restart against real processes.

Every request ends either with exactly the colocated engine's tokens or with a clear status;
afterwards every node holds nothing and the decode node exits 0 (conservation held).
Length: PDSERVE_SOAK_SECONDS (default 10, at most 180): the prefill node is killed at 30% of it
and started again at 50%, so traffic runs before, during and after the restart.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter

import grpc

from pdserve.client import generate, generate_stream
from pdserve.cluster import NodeProcess, stop_all
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from tests.test_faults import Nodes, metrics, target, wait_released

SECONDS = min(180.0, float(os.environ.get("PDSERVE_SOAK_SECONDS", "10")))
CLEAR_STATUSES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def test_soak_mixed_traffic_cancels_and_prefill_restart() -> None:
    rng = random.Random(7)
    reference = LLM(EngineConfig(model="tiny", num_kv_blocks=2048))
    nodes = Nodes()
    try:
        prefills = [nodes.prefill(), nodes.prefill()]
        decode = nodes.decode(prefills, "--kv-transfer-timeout", "5")
        outcomes = asyncio.run(_traffic(rng, reference, target(decode), prefills[0], nodes))
        assert outcomes["ok"] > 20, outcomes
        assert outcomes["cancelled"] > 0, outcomes
        live = [n for n in nodes.all if n.proc.poll() is None]
        wait_released(*live)
        assert metrics(decode)["pdserve_seats_in_use"] == 0
        decode.proc.send_signal(signal.SIGTERM)
        assert decode.proc.wait(30) == 0
    finally:
        stop_all(nodes.all, grace=10)


async def _traffic(
    rng: random.Random,
    reference: LLM,
    endpoint: str,
    victim: NodeProcess,
    nodes: Nodes,
) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    start = time.monotonic()
    restarted = False
    in_flight: set[asyncio.Future[None]] = set()
    while time.monotonic() - start < SECONDS:
        elapsed = time.monotonic() - start
        if victim.proc.poll() is None and elapsed > SECONDS * 0.3 and not restarted:
            victim.proc.kill()
        if victim.proc.poll() is not None and elapsed > SECONDS * 0.5 and not restarted:
            await asyncio.to_thread(nodes.prefill, port=int(victim.info["port"]))
            restarted = True
        prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 400))]
        max_tokens = rng.randint(1, 24)
        cancel = rng.random() < 0.2
        task = asyncio.ensure_future(
            _one(endpoint, prompt, max_tokens, cancel, reference, outcomes)
        )
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        while len(in_flight) >= 8:
            await asyncio.sleep(0.01)
        await asyncio.sleep(rng.expovariate(40))
    await asyncio.gather(*in_flight)
    assert restarted
    return outcomes


async def _one(
    endpoint: str,
    prompt: list[int],
    max_tokens: int,
    cancel: bool,
    reference: LLM,
    outcomes: Counter[str],
) -> None:
    try:
        if cancel:
            stream = generate_stream(endpoint, prompt, max_tokens=max_tokens, timeout=30)
            async for _ in stream:
                break  # walk away after the first message
            await stream.aclose()
            outcomes["cancelled"] += 1
            return
        result = await generate(endpoint, prompt, max_tokens=max_tokens, timeout=30)
    except grpc.aio.AioRpcError as e:
        assert e.code() in CLEAR_STATUSES, (e.code(), e.details())
        assert e.details()
        outcomes[e.code().name] += 1
        return
    want = reference.generate([prompt], SamplingParams(max_tokens=max_tokens))[0].token_ids
    assert result.token_ids == want
    outcomes["ok"] += 1
