"""Bursts against a real 1 prefill + 1 decode cluster (in-process nodes, real gRPC and UCX):
requests past what the KV pool holds queue instead of being refused, each comes out token-exact,
and after every scenario both nodes hold nothing."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator, Sequence

import grpc
import pytest

from pdserve.client import create_channel, generate, generate_stream
from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore
from shared.engine.llm import LLM
from shared.engine.requests.request import LlmRequestState as S
from shared.engine.sampling.sampling_params import SamplingParams
from tests.engine_helpers import random_max_tokens, random_prompts, single_torch_thread
from tests.support.cluster import PdCluster, pd_cluster

MODEL = "tiny"
VOCAB = 256  # byte tokens only: clear of the tiny model's special ids
POOL = EngineConfig(model=MODEL, num_kv_blocks=200, block_size=16)  # ~3,200 tokens


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


@pytest.fixture(scope="module")
def reference() -> LLM:
    """The colocated engine with a pool that never runs short (token-exact with transformers,
    tests/test_engine_parity.py)."""
    return LLM(EngineConfig(model=MODEL, num_kv_blocks=8192, max_batch_size=64))


def expected(reference: LLM, prompts: Sequence[list[int]], max_tokens: Sequence[int]):
    params = [SamplingParams(max_tokens=m) for m in max_tokens]
    return [o.token_ids for o in reference.generate(prompts, params)]


async def burst(c: PdCluster, prompts, max_tokens, timeout: float = 120) -> list[object]:
    channel = create_channel(c.targets[0])
    try:
        return await asyncio.gather(
            *(
                generate(c.targets[0], p, max_tokens=m, timeout=timeout, channel=channel)
                for p, m in zip(prompts, max_tokens, strict=True)
            ),
            return_exceptions=True,
        )
    finally:
        await channel.close()


def test_burst_of_400_queues_and_every_request_is_exact(reference: LLM) -> None:
    """A burst: 400 concurrent greedy requests (prompts 1-400 tokens, max_tokens
    1-64) against a 200-block pool on both nodes, max_inflight 64, a queue of 400."""
    prompts = random_prompts(400, VOCAB, min_len=1, max_len=400, seed=170)
    max_tokens = random_max_tokens(400, lo=1, hi=64, seed=171)
    want = expected(reference, prompts, max_tokens)

    async def body() -> None:
        overrides = {"max_inflight": 64, "max_queued": 400}
        async with pd_cluster(
            MODEL, prefill_engine=POOL, decode_engine=POOL, decode_overrides=overrides
        ) as c:
            results = await burst(c, prompts, max_tokens)
            errors = [r for r in results if isinstance(r, BaseException)]
            assert not errors, f"{len(errors)} failed, first: {errors[0]!r}"
            assert [r.token_ids for r in results] == want
            assert max(r.timing.queue_seconds for r in results) > 0  # some did queue
            m = (await asyncio.to_thread(c.metrics))[1]  # the decode node
            assert m["pdserve_queue_seconds_count"] == 400
            assert m['pdserve_requests{state="QUEUED"}'] == 0
            await c.assert_idle_and_conserved()

    asyncio.run(body())


async def _hold_engine(c: PdCluster, commands: int) -> tuple[threading.Event, asyncio.Future]:
    """Block the decode engine thread on a command until `commands` more are queued behind it,
    then queue a probe after them: everything in the burst reaches admission with no step in
    between (nothing finishes), so what is admitted, queued and refused is exact."""
    thread = c.decodes[0].thread
    gate = threading.Event()
    thread.inspect_soon(lambda core: gate.wait(60))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while len(thread._commands) < commands:
        assert loop.time() < deadline, f"only {len(thread._commands)} requests arrived"
        await asyncio.sleep(0.01)
    probe = asyncio.wrap_future(
        thread.inspect_soon(lambda core: (len(core.requests), len(core.role.admission)))
    )
    return gate, probe


def test_max_queued_refuses_exactly_the_overflow(reference: LLM) -> None:
    n = 400
    prompts = random_prompts(n, VOCAB, min_len=1, max_len=400, seed=172)
    max_tokens = random_max_tokens(n, lo=1, hi=16, seed=173)
    want = expected(reference, prompts, max_tokens)

    async def body() -> None:
        overrides = {"max_inflight": 64, "max_queued": 100}
        async with pd_cluster(
            MODEL, prefill_engine=POOL, decode_engine=POOL, decode_overrides=overrides
        ) as c:
            task = asyncio.ensure_future(burst(c, prompts, max_tokens))
            gate, probe = await _hold_engine(c, n)
            gate.set()
            live, queued = await probe
            results = await task
            refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            assert queued == 100 and len(refused) == n - live  # admitted + queued = live
            assert len(refused) == n - 100 - (live - queued)
            for r in refused:
                assert r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, r
                assert "admission queue is full" in r.details()
                assert int(dict(r.trailing_metadata())["retry-after"]) >= 1
            for r, w in zip(results, want, strict=True):
                if not isinstance(r, BaseException):
                    assert r.token_ids == w
            await c.assert_idle_and_conserved()

    asyncio.run(body())


async def long_request(c: PdCluster, n: int = 1500) -> asyncio.Future:
    """Start a long request and return once it is decoding (it holds the one inflight slot)."""
    task = asyncio.ensure_future(
        generate(c.targets[0], list(range(3, 40)), max_tokens=n, ignore_eos=True, timeout=120)
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not c.decodes[0].thread.snapshot.requests_by_state["GENERATION_IN_PROGRESS"]:
        assert loop.time() < deadline, "the long request never started decoding"
        await asyncio.sleep(0.005)
    return task


async def wait_queued(c: PdCluster, n: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while c.decodes[0].thread.snapshot.queued < n:
        assert loop.time() < deadline, "requests never queued"
        await asyncio.sleep(0.005)


ONE_AT_A_TIME = {"max_inflight": 1}


def test_deadline_expires_in_the_queue(reference: LLM) -> None:
    async def body() -> None:
        async with pd_cluster(MODEL, decode_overrides=ONE_AT_A_TIME) as c:
            first = await long_request(c)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(c.targets[0], [5, 6, 7], max_tokens=4, timeout=0.3)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert len((await first).token_ids) == 1500
            # it ended where it waited: straight out of the queue, never holding a block (as
            # aborted, or as failed when the node's own deadline timer fired first)
            ended = [[st for st, _ in h] for _, h in c.decodes[0].core.recent_history]
            assert any(len(h) == 2 and h[0] == S.QUEUED for h in ended), ended
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def test_cancel_in_the_queue_frees_nothing_and_leaves_it(reference: LLM) -> None:
    prompt = [9, 10, 11, 12]
    want = expected(reference, [prompt], [6])[0]

    async def body() -> None:
        async with pd_cluster(MODEL, decode_overrides=ONE_AT_A_TIME) as c:
            first = await long_request(c)
            stream = generate_stream(c.targets[0], [5, 6, 7], max_tokens=4, timeout=60)
            task = asyncio.ensure_future(stream.__anext__())
            await wait_queued(c, 1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await task
            await stream.aclose()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while c.decodes[0].thread.snapshot.queued:
                assert loop.time() < deadline, "cancelled request stayed queued"
                await asyncio.sleep(0.005)

            def holders(core: EngineCore) -> tuple[int, int, int]:
                kv = core.kv_manager
                return len(core.requests), len(kv.block_tables), len(kv.pinned)

            # only the long request is left holding anything (a count of blocks in use would
            # race it: it takes a new block every 16 tokens it decodes)
            assert await c.decodes[0].thread.inspect(holders) == (1, 1, 0)
            assert len((await first).token_ids) == 1500
            again = await generate(c.targets[0], prompt, max_tokens=6, timeout=60)
            assert again.token_ids == want
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def test_stop_answers_queued_requests_unavailable(reference: LLM) -> None:
    """What SIGTERM runs (pdserve/nodes.py): queued requests are answered UNAVAILABLE at once,
    the admitted one finishes within the grace, and every seat and block is conserved."""

    async def body() -> None:
        async with pd_cluster(MODEL, decode_overrides=ONE_AT_A_TIME) as c:
            first = await long_request(c)
            queued = [
                asyncio.ensure_future(generate(c.targets[0], [5, 6, 7 + i], max_tokens=4))
                for i in range(3)
            ]
            await wait_queued(c, 3)
            decode = c.decodes.pop()  # stopped here, not again by the harness
            assert await decode.stop(grace=30)  # seats and blocks conserved
            for q in queued:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await q
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "still queued" in err.value.details()
            assert len((await first).token_ids) == 1500
            await c.assert_idle_and_conserved()  # the prefill node too

    asyncio.run(body())
