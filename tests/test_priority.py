"""Priorities (vLLM's `priority`, lower first) order the admission queue, aging bounds how long
later arrivals can pass a queued request, and preemption takes the newest of the lowest
priority first."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

import pytest

from pdserve.client import create_channel
from proto.pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.engine.requests.request import LlmRequest, LlmRequestState
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.scheduling.admission_queue import AdmissionQueue
from shared.engine.scheduling.scheduler import _victim
from shared.engine.scheduling.service_level import MAX_PRIORITY, MIN_PRIORITY, ServiceLevel
from tests.engine_helpers import single_torch_thread
from tests.support.cluster import PdCluster, pd_cluster
from tests.test_admission_cluster import long_request, wait_queued

MODEL = "tiny"


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


def test_priority_orders_the_queue_ties_in_arrival_order() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(max_queued=10, aging_s=1.0)
    q.push("a", "a", now=0.0, priority=5)
    q.push("b", "b", now=0.1, priority=0)
    q.push("c", "c", now=0.2, priority=-5)
    q.push("d", "d", now=0.3, priority=0)
    assert q.keys() == ["c", "b", "d", "a"]
    q.push_front("p", "p", now=0.4)  # a preempted request: ahead of every priority
    assert q.keys() == ["p", "c", "b", "d", "a"]
    assert q.remove("b") is not None and q.keys() == ["p", "c", "d", "a"]
    admitted = q.admit(lambda e: e.key != "a", now=1.0)
    assert [e.key for e in admitted] == ["p", "c", "d"] and q.keys() == ["a"]


def test_aging_lets_a_waiting_request_pass_later_better_ones() -> None:
    q: AdmissionQueue[str] = AdmissionQueue(max_queued=10, aging_s=1.0)
    q.push("low", "low", now=0.0, priority=3)
    q.push("early", "early", now=2.9, priority=0)  # within 3 levels x 1 s: it passes
    q.push("late", "late", now=3.1, priority=0)  # past the bound: it does not
    assert q.keys() == ["early", "low", "late"]


def test_no_starvation_under_a_stream_of_top_priority_requests() -> None:
    """Overload: a MIN_PRIORITY request arrives every 1 ms and one request is admitted every
    2 ms, so strict priorities would hold the MAX_PRIORITY one for ever. With aging, nothing
    that arrived more than (MAX_PRIORITY - MIN_PRIORITY) x aging_s after it passes it."""
    aging = 0.001
    bound = (MAX_PRIORITY - MIN_PRIORITY) * aging  # 2 s
    q: AdmissionQueue[float] = AdmissionQueue(max_queued=100_000, aging_s=aging)
    q.push("low", 0.0, now=0.0, priority=MAX_PRIORITY)
    admitted_before: list[float] = []
    low_admitted_at = None
    for ms in range(1, 6000):
        now = ms / 1000
        q.push(f"high{ms}", now, now=now, priority=MIN_PRIORITY)
        if ms % 2 == 0:
            (entry,) = q.admit(_once(), now)  # one admission per round
            if entry.key == "low":
                low_admitted_at = now
                break
            admitted_before.append(entry.item)
    assert low_admitted_at is not None, "the low-priority request starved"
    assert max(admitted_before) <= bound
    assert low_admitted_at <= 2 * bound  # the bound plus admitting what had queued by then


def _once() -> Callable[[object], bool]:
    seats = [True]
    return lambda entry: bool(seats) and seats.pop()


def _running(rid: str, priority: int) -> LlmRequest:
    params = SamplingParams(max_tokens=4, service=ServiceLevel(priority=priority))
    return LlmRequest(rid, [1, 2], params, state=LlmRequestState.GENERATION_IN_PROGRESS)


def test_preemption_takes_the_newest_of_the_lowest_priority() -> None:
    oldest, a, b, newest = (_running("o", 0), _running("a", 7), _running("b", 7), _running("n", 0))
    assert _victim([oldest, a, b, newest]) is b
    assert _victim([oldest, newest]) is newest  # equal priorities: the newest, as before


def _request(rid: str, priority: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=rid,
        token_ids=generation_pb2.TokenIds(ids=[5, 6, 7, 8]),
        sampling=generation_pb2.SamplingParams(max_tokens=3),
        priority=priority,
    )


async def _run(c: PdCluster, request: generation_pb2.GenerateRequest, done: list[str]) -> None:
    channel = create_channel(c.targets[0])
    try:
        stub = generation_pb2_grpc.GenerationStub(channel)
        async for _ in stub.Generate(request, timeout=120):
            pass
        done.append(request.request_id)
    finally:
        await channel.close()


def test_priorities_reorder_the_queue_end_to_end() -> None:
    """One inflight slot held by a long request; three requests queue behind it in the order
    5, 0, -5 and are admitted -5, 0, 5."""

    async def body() -> None:
        async with pd_cluster(MODEL, decode_overrides={"max_inflight": 1}) as c:
            first = await long_request(c)
            done: list[str] = []
            tasks = []
            for i, (rid, priority) in enumerate((("p5", 5), ("p0", 0), ("m5", -5))):
                tasks.append(asyncio.ensure_future(_run(c, _request(rid, priority), done)))
                await wait_queued(c, i + 1)
            order = await c.decodes[0].thread.inspect(lambda core: core.role.admission.queue.keys())
            assert order == ["m5", "p0", "p5"]
            first.cancel()  # frees the slot: the queue drains in its order, one at a time
            with contextlib.suppress(asyncio.CancelledError):
                await first
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert done == ["m5", "p0", "p5"]
            await c.assert_idle_and_conserved()

    asyncio.run(body())
