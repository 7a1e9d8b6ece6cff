"""A prefill node killed and restarted on its address is a new peer (real processes, tiny model).

Under load, every request completes with the right tokens or fails cleanly; the decode node
learns the new process instance (and only that one is routed to), and every seat and block is
back on both nodes afterwards. A peer that stops answering after its blocks were reserved has
them back on the decode node within the KV lease, whatever it does."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc

from pdserve.client import generate
from pdserve.cluster import NodeProcess
from shared.engine.sampling.sampling_params import SamplingParams
from shared.serving.limits import KV_FENCE_TIMEOUT_S
from tests.engine_helpers import random_prompts
from tests.test_faults import (
    VOCAB,
    Nodes,
    check_fresh_batch,
    metrics,
    nodes,
    reference,
    target,
    until_busy,
)
from tests.test_faults import wait_released as wait_released
from tests.test_prefill_stall import until_pushing

__all__ = ["nodes", "reference"]  # the fixtures these tests take


def instances(decode: NodeProcess, prefill: NodeProcess) -> set[str]:
    """The instance ids the decode node knows `prefill`'s address by."""
    peer = f'peer="{target(prefill)}"'
    name = "pdserve_prefill_peer_instance{"
    return {
        k.split('instance="')[1].split('"')[0]
        for k, v in metrics(decode).items()
        if k.startswith(name) and peer in k and v == 1
    }


def test_a_prefill_node_restarted_under_load_is_a_new_peer(nodes: Nodes, reference) -> None:
    a = nodes.prefill("--max-num-tokens", "64")
    d = nodes.decode([a], "--prefill-retries", "2")
    check_fresh_batch(d, reference, seed=11)
    (old,) = instances(d, a)
    prompts = random_prompts(12, VOCAB, min_len=300, max_len=900, seed=12)
    want = [o.token_ids for o in reference.generate(prompts, SamplingParams(max_tokens=4))]

    async def one(prompt: list[int]) -> object:
        try:
            return await generate(target(d), prompt, max_tokens=4, timeout=60)
        except grpc.aio.AioRpcError as e:  # clean: a status, no hang, nothing held
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            return None

    async def load() -> list[object]:
        calls = [asyncio.ensure_future(one(p)) for p in prompts]
        await until_pushing(a)
        a.proc.kill()
        a.proc.wait()
        nodes.prefill("--max-num-tokens", "64", port=int(a.info["port"]))
        return await asyncio.gather(*calls)

    got = asyncio.run(load())
    for g, w in zip(got, want, strict=True):
        assert g is None or g.token_ids == w
    b = nodes.all[-1]
    deadline = time.monotonic() + 15
    while instances(d, b) in (set(), {old}):
        assert time.monotonic() < deadline, "the decode node never learnt the new instance"
        time.sleep(0.2)
    (new,) = instances(d, b)
    assert new != old
    assert metrics(d)["pdserve_prefill_peer_restarts_total"] >= 1
    check_fresh_batch(d, reference, seed=13)  # served by the new instance, KV stamped by it
    assert instances(d, b) == {new}
    wait_released(d, b)


def test_a_peer_stopped_after_the_reservation_frees_its_blocks_within_the_lease(
    nodes: Nodes,
) -> None:
    lease = 1.5  # --kv-transfer-timeout: the KV lease; the Prefill call's own deadline is longer
    # a payload write still posted into the blocks when the lease ends gets this long before
    # the KV endpoints are force-closed (KV_FENCE_TIMEOUT_S), then their close (2 s)
    fence = KV_FENCE_TIMEOUT_S + 2.0
    a = nodes.prefill("--max-num-tokens", "64")
    d = nodes.decode(
        [a],
        "--kv-transfer-timeout",
        str(lease),
        "--prefill-timeout",
        "60",
    )
    prompt = random_prompts(1, VOCAB, min_len=1800, max_len=1800, seed=14)[0]

    async def body() -> float:
        call = asyncio.ensure_future(generate(target(d), prompt, max_tokens=2, timeout=60))
        await until_busy(a)  # computing its chunks: the decode node's blocks are granted to it
        a.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            await call
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        return stopped

    stopped = asyncio.run(body())
    while metrics(d)["pdserve_kv_blocks_in_use"] > 0:
        assert time.monotonic() - stopped < lease + fence + 1.0, "blocks held past the lease"
        time.sleep(0.05)
    a.proc.send_signal(signal.SIGCONT)
    wait_released(d, a)
