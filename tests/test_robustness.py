"""Cancellation in every state, deadlines, overload, forged KV messages, malformed gRPC.

In-process nodes (real gRPC, real UCX); after each scenario both sides hold nothing and a fresh
request is served correctly. The public-contract scenarios run twice: against a P/D pair and
against a colocated node (`pdserve colocated`), which promises the same contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from pdserve.client import generate, generate_stream
from shared.engine.config import EngineConfig
from shared.engine.requests.request import LlmRequestState
from tests.engine_helpers import hf_greedy, random_prompts
from tests.support.cluster import PdCluster, pd_cluster

S = LlmRequestState
# the same public contract from a P/D pair and from a colocated node
TOPOLOGY = pytest.mark.parametrize("colocated", [False, True], ids=["pd", "colocated"])


def slow(path: Path, step_tokens: int = 32) -> EngineConfig:
    return EngineConfig(model=str(path), num_kv_blocks=1024, max_num_tokens=step_tokens)


async def fresh_request_ok(c: PdCluster, path: Path) -> None:
    r = await generate(c.targets[0], [11, 12, 13, 14], max_tokens=5, timeout=30)
    assert r.token_ids == hf_greedy(path, [11, 12, 13, 14], 5)
    await c.assert_idle_and_conserved()


async def wait_for_state(c: PdCluster, state: LlmRequestState, timeout: float = 20) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not c.decodes[0].thread.snapshot.requests_by_state.get(state.name):
        assert loop.time() < deadline, f"never saw a request in {state.name}"
        await asyncio.sleep(0.002)


@TOPOLOGY
@pytest.mark.parametrize("cancel_at", ["immediately", "prefilling", "first_token", "decoding"])
def test_client_cancel_in_every_state(
    cancel_at: str, colocated: bool, checkpoint: Callable[..., Path]
) -> None:
    path = checkpoint("llama")
    prompt = random_prompts(1, 512, min_len=600, max_len=600, seed=61)[0]
    # while the prompt computes: its KV on the way (P/D), or its chunks running here
    prefilling = S.CONTEXT_INIT if colocated else S.DISAGG_GENERATION_TRANS_IN_PROGRESS

    async def body() -> None:
        async with pd_cluster(path, prefill_engine=slow(path), colocated=colocated) as c:
            stream = generate_stream(c.targets[0], prompt, max_tokens=200, ignore_eos=True)
            task = asyncio.ensure_future(_consume(stream, cancel_at))
            if cancel_at == "immediately":
                await asyncio.sleep(0)
                task.cancel()
            elif cancel_at == "prefilling":
                await wait_for_state(c, prefilling)
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            with contextlib.suppress(Exception):
                await stream.aclose()
            await fresh_request_ok(c, path)
            # late KV messages of the cancelled transfer were dropped, never written
            assert all(p.thread.snapshot.blocks_pinned == 0 for p in c.prefills)

    asyncio.run(body())


async def _consume(stream, cancel_at: str) -> None:
    n = 0
    async for chunk in stream:
        n += len(chunk.token_ids)
        if cancel_at == "first_token" and n >= 1:
            return
        if cancel_at == "decoding" and n >= 20:
            return


@TOPOLOGY
def test_client_deadline_during_prefill(colocated: bool, checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    prompt = random_prompts(1, 512, min_len=900, max_len=900, seed=62)[0]

    async def body() -> None:
        # 4-token steps: 225 of them, far past the 50 ms deadline however fast the engine
        async with pd_cluster(path, prefill_engine=slow(path, 4), colocated=colocated) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(c.targets[0], prompt, max_tokens=4, timeout=0.05)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await fresh_request_ok(c, path)

    asyncio.run(body())


def test_kv_transfer_timeout_fails_with_clear_status(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    prompt = random_prompts(1, 512, min_len=900, max_len=900, seed=63)[0]

    async def body() -> None:
        overrides = {"kv_transfer_timeout": 0.05, "prefill_retries": 0}
        # 4-token steps: ~225 prefill steps, far past 50 ms; at 32-token steps a fast run of
        # the tiny model finished the whole prefill inside the timeout
        prefill = slow(path, step_tokens=4)
        async with pd_cluster(path, prefill_engine=prefill, decode_overrides=overrides) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(c.targets[0], prompt, max_tokens=4, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "timed out" in err.value.details()
            states = [s for _, h in c.decodes[0].core.recent_history for s, _ in h]
            assert S.DISAGG_TRANS_ERROR in states
            await c.assert_idle_and_conserved()

    asyncio.run(body())


@TOPOLOGY
def test_overload_is_resource_exhausted_at_once(
    colocated: bool, checkpoint: Callable[..., Path]
) -> None:
    """Past max_inflight requests queue; past max_queued they are refused at once, with a
    retry hint in the trailing metadata."""
    path = checkpoint("llama")
    prompts = random_prompts(8, 512, min_len=200, max_len=300, seed=64)

    async def body() -> None:
        overrides = {"max_inflight": 2, "max_queued": 2}
        async with pd_cluster(path, decode_overrides=overrides, colocated=colocated) as c:
            results = await asyncio.gather(
                *(generate(c.targets[0], p, max_tokens=30, timeout=60) for p in prompts),
                return_exceptions=True,
            )
            refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            served = [r for r in results if not isinstance(r, BaseException)]
            assert refused and len(served) >= 4  # 2 in flight + 2 queued at least
            assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
            assert "admission queue is full" in refused[0].details()
            trailing = dict(refused[0].trailing_metadata() or ())
            assert int(trailing["retry-after"]) >= 1
            await fresh_request_ok(c, path)

    asyncio.run(body())


@TOPOLOGY
def test_duplicate_request_id_in_flight(colocated: bool, checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")

    async def body() -> None:
        async with pd_cluster(path, colocated=colocated) as c:
            first = asyncio.ensure_future(
                generate(c.targets[0], [5] * 50, max_tokens=100, request_id="dup", ignore_eos=True)
            )
            await wait_for_state(c, S.GENERATION_IN_PROGRESS)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(c.targets[0], [5, 6], max_tokens=2, request_id="dup")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "dup" in err.value.details()
            assert (await first).request_id == "dup"
            await fresh_request_ok(c, path)

    asyncio.run(body())


@TOPOLOGY
def test_malformed_and_oversized_grpc_requests(
    colocated: bool, checkpoint: Callable[..., Path]
) -> None:
    path = checkpoint("llama")

    async def body() -> None:
        async with pd_cluster(path, colocated=colocated) as c:
            async with grpc.aio.insecure_channel(c.targets[0]) as ch:
                raw = ch.unary_stream("/pdserve.v1.Generation/Generate")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in raw(b"\xff\xff\xff\x0f garbage"):
                        pass
                assert err.value.code() in (
                    grpc.StatusCode.INTERNAL,
                    grpc.StatusCode.UNKNOWN,
                    grpc.StatusCode.INVALID_ARGUMENT,
                )
            big = "x" * (65 * 2**20)  # over the 64 MiB message limit
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(c.targets[0], big, max_tokens=1, timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await fresh_request_ok(c, path)

    asyncio.run(body())


async def rejected_total(c: PdCluster) -> float:
    samples = await asyncio.to_thread(c.metrics)  # the servers share this event loop
    return samples[-1]["pdserve_kv_transfer_rejected_total"]


def test_forged_kv_messages_are_dropped_and_counted(checkpoint: Callable[..., Path]) -> None:
    from tests.test_transfer import Peer

    path = checkpoint("llama")

    async def body() -> None:
        async with pd_cluster(path) as c:
            node = c.decodes[0]
            peer = await Peer.spawn("sender")
            try:
                before = (await asyncio.to_thread(c.metrics))[-1][
                    "pdserve_kv_transfer_rejected_total"
                ]
                for data in (os.urandom(300), os.urandom(70_000), b"tiny"):
                    reply = await peer.call(
                        cmd="raw",
                        address=node.receiver.address,
                        messages=[[secrets.randbits(64), data.hex()]],
                    )
                    assert reply["ok"], reply
                await asyncio.sleep(0.3)
                after = (await asyncio.to_thread(c.metrics))[-1][
                    "pdserve_kv_transfer_rejected_total"
                ]
                assert after >= before + 3
            finally:
                await peer.stop()
            await fresh_request_ok(c, path)

    asyncio.run(body())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
