"""SLO-aware admission (shared/engine/scheduling/slo.py): a request whose predicted time to first
token misses its target is refused at once, with a retry hint and nothing allocated; the ITL bound
holds new requests out of a batch measured too slow; defaults off change nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import httpx
import pytest

from pdserve.client import create_channel, generate
from proto.pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.engine.requests.request import LlmRequest, LlmRequestState
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.scheduling.service_level import ServiceLevel
from shared.engine.scheduling.slo import (
    ERROR_MAX_AGE_S,
    Ewma,
    PrefillRate,
    SloMiss,
    SloPolicy,
    StepTimes,
)
from tests.engine_helpers import random_prompts, single_torch_thread
from tests.support.cluster import PdCluster, pd_cluster

MODEL = "tiny"
PROMPT = random_prompts(1, 256, min_len=300, max_len=300, seed=901)[0]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


def _request(rid: str, service: ServiceLevel) -> LlmRequest:
    params = SamplingParams(max_tokens=4, service=service)
    return LlmRequest(rid, [1, 2, 3], params, state=LlmRequestState.GENERATION_IN_PROGRESS)


# ---- units ------------------------------------------------------------------------------------
def test_prefill_rate_counts_busy_time_only() -> None:
    rate = PrefillRate()
    rate.started("a", 100, now=10.0)
    rate.finished("a", now=11.0)  # 100 tokens in 1 busy second
    assert rate.tokens_per_s == pytest.approx(100)
    rate.started("b", 100, now=50.0)  # the idle gap 11 -> 50 is not counted
    rate.started("c", 100, now=50.0)
    rate.finished("b", now=50.5)
    rate.finished("c", now=51.0)  # overlapping: 200 tokens in 1 busy second
    # a prediction takes the speed of a prefill that had the path to itself
    assert rate.tokens_per_s == pytest.approx(100)
    rate.finished("never-started", now=60.0)  # ignored, as is a dropped one
    rate.started("d", 100, now=70.0)
    rate.drop("d")
    rate.finished("d", now=90.0)
    assert rate.tokens_per_s == pytest.approx(100)
    only_shared = PrefillRate()
    for rid in ("b", "c"):
        only_shared.started(rid, 100, now=50.0)
    only_shared.finished("b", now=50.5)
    only_shared.finished("c", now=51.0)
    assert only_shared.tokens_per_s == pytest.approx(200)  # none alone: the throughput


def test_prefill_rate_is_not_fooled_by_first_tokens_that_arrive_together() -> None:
    """Three 100-token prompts whose first tokens reach the event loop within a millisecond of
    each other after 1 busy second: 300 tokens/s, not the ~100,000 a rate per completion would
    average to."""
    rate = PrefillRate()
    for rid in "abc":
        rate.started(rid, 100, now=0.0)
    for i, rid in enumerate("abc"):
        rate.finished(rid, now=1.0 + i * 0.0005)
    assert rate.tokens_per_s == pytest.approx(300, rel=0.01)


def test_ttft_check_refuses_with_a_retry_hint_or_records_the_prediction() -> None:
    slo = SloPolicy(ttft_slo_ms=1000)
    loose = ServiceLevel(ttft_slo_ms=60_000)
    assert slo.check_ttft("a", 10_000, 0, ServiceLevel()) is None  # no rate yet: no basis
    slo.rate.sample(1000, 1.0)  # 1000 tokens/s
    assert slo.check_ttft("b", 500, 0, ServiceLevel()) == pytest.approx(0.5)
    with pytest.raises(SloMiss) as err:
        slo.check_ttft("c", 500, 3000, ServiceLevel())  # 3.5 s against the node's 1 s
    assert err.value.retry_after_s == 3
    assert "3000 prompt tokens ahead" in str(err.value) and "target 1000ms" in str(err.value)
    with pytest.raises(SloMiss, match=r"target 0\.5ms "):  # a sub-ms target, as it was asked
        slo.check_ttft("c2", 500, 0, ServiceLevel(ttft_slo_ms=0.5))
    errors: list[float] = []
    slo.on_error = errors.append
    for rid in ("d", "d2", "d3"):
        assert slo.check_ttft(rid, 500, 3000, loose, now=4.0) == pytest.approx(3.5)  # its own
        slo.first_token(rid, ttft=3.0, now=5.0)
    assert errors == [pytest.approx(0.5)] * 3
    # what the model missed (it took 0.5 s less) is learnt: later predictions shift by it
    assert slo.check_ttft("f", 500, 3000, loose, now=6.0) == pytest.approx(3.0)
    with pytest.raises(SloMiss) as err:
        slo.check_ttft("e", 10**6, 0, loose)
    assert err.value.retry_after_s == 60  # clamped


def test_predictions_add_the_p90_of_past_errors_not_their_mean() -> None:
    """Admitted at the target's edge, a request must meet it at p90: with 2 of 20 past requests
    0.4 s later than modelled, a mean (+0.04 s) would admit a 0.7 s prediction against 1 s."""
    slo = SloPolicy(ttft_slo_ms=1000)
    slo.rate.sample(1000, 1.0)  # 1000 tokens/s
    for i in range(20):
        slo.check_ttft(f"r{i}", 100, 400, ServiceLevel(), now=1.0)  # modelled 0.5 s
        slo.first_token(f"r{i}", ttft=0.9 if i in (3, 11) else 0.5, now=1.5)
    assert slo.bias.value(0.5, now=2.0) == pytest.approx(0.4)
    with pytest.raises(SloMiss):
        slo.check_ttft("late", 100, 600, ServiceLevel(), now=2.0)  # 0.7 + 0.4 > 1 s
    assert slo.check_ttft("fits", 100, 400, ServiceLevel(), now=2.0) == pytest.approx(0.9)


def test_errors_count_only_while_recent_and_for_predictions_of_their_size() -> None:
    """A burst's deep queue (predictions of seconds, its batches seconds late) says nothing of
    a request that finds the path idle, and once the burst is over its errors stop counting."""
    slo = SloPolicy(ttft_slo_ms=1000)
    slo.rate.sample(1000, 1.0)
    for i in range(10):
        slo.check_ttft(f"deep{i}", 500, 5000, ServiceLevel(ttft_slo_ms=60_000), now=10.0)
        slo.first_token(f"deep{i}", ttft=9.0, now=19.0)  # modelled 5.5 s, 3.5 s late
    assert slo.bias.value(5.5, now=20.0) == pytest.approx(3.5)
    assert slo.bias.value(0.5, now=20.0) is None  # another size: nothing learnt for it
    assert slo.check_ttft("idle", 500, 0, ServiceLevel(), now=20.0) == pytest.approx(0.5)
    assert slo.bias.value(5.5, now=19.0 + ERROR_MAX_AGE_S + 1) is None  # too old


def test_a_newcomer_that_would_make_an_admitted_request_late_is_refused() -> None:
    """Prompts that reach a prefill node together finish together: a prompt that would join
    the step of one already admitted, due 1 s after it arrived, and end that step too late is
    refused; one that is already in the step under way is not held back by newcomers, nor is
    one whose first token came, and a deadline already passed protects nothing."""
    slo = SloPolicy(ttft_slo_ms=1000)
    slo.rate.sample(1000, 1.0)
    loose = ServiceLevel(ttft_slo_ms=5000)
    slo.check_ttft("running", 500, 0, ServiceLevel(), now=0.0)  # due at 1.0
    slo.rate.started("running", 500, now=0.0)  # from idle: the step under way
    assert slo.check_ttft("after", 500, 500, loose, now=0.1) is not None  # done at ~0.9+0.5
    slo.check_ttft("a", 100, 1000, ServiceLevel(), now=0.1)  # due at 1.1, waits for a step
    slo.rate.started("a", 100, now=0.1)
    with pytest.raises(SloMiss, match="already admitted miss") as err:
        slo.check_ttft("c", 500, 1100, loose, now=0.2)  # with a: done at ~1.7 > 1.1
    assert err.value.retry_after_s >= 1
    slo.first_token("a", ttft=0.5, now=0.6)
    assert slo.check_ttft("c", 500, 1100, loose, now=0.6) is not None
    slo.check_ttft("d", 100, 0, ServiceLevel(ttft_slo_ms=200), now=1.0)  # due at 1.2, then lost
    slo.rate.started("d", 100, now=1.0)
    assert slo.check_ttft("e", 500, 1000, loose, now=2.0) is not None


def test_tokens_ahead_count_the_progress_of_prefills_in_flight() -> None:
    """A 500-token prefill started 0.3 s ago at 1000 tokens/s has 200 tokens left."""
    slo = SloPolicy(ttft_slo_ms=1000)
    slo.rate.sample(1000, 1.0)
    slo.rate.started("running", 500, now=10.0)
    assert slo.rate.progress(10.3, 1000.0) == pytest.approx(300)
    assert slo.check_ttft("next", 500, 500, ServiceLevel(), now=10.3) == pytest.approx(0.7)
    assert slo.rate.progress(20.0, 1000.0) == 500  # at most what is in flight


def test_step_times_measure_busy_step_to_step_gaps() -> None:
    steps = StepTimes()
    steps.tick(num_steps=0, batch=0, now=0.0)
    steps.tick(num_steps=1, batch=4, now=5.0)  # after an idle engine: not a step time
    assert steps.estimate(4) is None
    steps.tick(num_steps=1, batch=4, now=5.01)  # a command between steps: no new sample
    steps.tick(num_steps=2, batch=4, now=5.1)
    assert steps.estimate(4) == pytest.approx(0.1)
    assert steps.estimate(2) == pytest.approx(0.1)  # nearest measured at or above
    assert steps.estimate(9) == pytest.approx(0.1)  # else the largest below


def test_itl_bound_holds_a_request_that_would_slow_the_batch() -> None:
    slo = SloPolicy(itl_slo_ms=None)
    tight, free = ServiceLevel(itl_slo_ms=50), ServiceLevel()
    running = [_request(f"r{i}", free) for i in range(3)]
    candidate = _request("new", free)
    slo.steps.by_batch.setdefault(4, Ewma()).update(0.08)  # 80 ms at batch 4
    assert not slo.batch_too_slow(running, candidate)  # no ITL target anywhere
    running[1] = _request("r1", tight)
    assert slo.batch_too_slow(running, candidate)  # 80 ms > r1's 50 ms
    assert not slo.batch_too_slow([], _request("alone", tight))  # alone: nothing to protect
    slo.itl_slo_ms = 100  # a node default covers the others, r1's own 50 ms still binds
    assert slo.batch_too_slow(running, candidate)


# ---- end to end -------------------------------------------------------------------------------
async def _warm(c: PdCluster) -> None:
    """One request through, so that the prefill rate has a sample (until then nothing is
    refused: there is no basis for a prediction)."""
    await generate(c.targets[0], PROMPT, max_tokens=2, timeout=60)
    # the rate's sample is taken when the first token reaches the node's event loop, which may
    # come after the client has its whole (two-token) answer
    rate = c.decodes[0].core.role.admission.slo.rate
    for _ in range(1000):
        if rate.tokens_per_s is not None:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no prefill rate measured 10 s after a request was served")


def _grpc_request(rid: str, ttft_slo_ms: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=rid,
        token_ids=generation_pb2.TokenIds(ids=PROMPT),
        sampling=generation_pb2.SamplingParams(max_tokens=4),
        ttft_slo_ms=ttft_slo_ms,
    )


async def _refused_grpc(c: PdCluster, rid: str, ttft_slo_ms: int) -> grpc.aio.AioRpcError:
    channel = create_channel(c.targets[0])
    try:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(_grpc_request(rid, ttft_slo_ms), timeout=60):
                pass
        return err.value
    finally:
        await channel.close()


def _never_created(c: PdCluster, rid: str) -> None:
    core = c.decodes[0].core
    assert rid not in core.requests
    assert all(not r.startswith(rid) for r, _ in core.recent_history), "it was created"


def test_predicted_ttft_miss_is_refused_at_once_grpc_and_http() -> None:
    """A 1 ms target cannot be met by a 300-token prompt at any rate this node measures: the
    refusal comes at once (429 / RESOURCE_EXHAUSTED, retry hint), nothing was allocated, and a
    request with a loose target is served and its prediction error exported."""

    async def body() -> None:
        async with pd_cluster(MODEL, decode_overrides={"http_port": 0}) as c:
            await _warm(c)
            err = await _refused_grpc(c, "slo-grpc", ttft_slo_ms=1)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert "predicted time to first token" in err.details()
            assert int(dict(err.trailing_metadata())["retry-after"]) >= 1
            _never_created(c, "slo-grpc")
            await c.assert_idle_and_conserved()

            url = f"http://127.0.0.1:{c.decodes[0].http_port}"
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "ttft_slo_ms": 0.5}
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 429, resp.text
                assert int(resp.headers["retry-after"]) >= 1
                assert "predicted time to first token" in resp.json()["error"]["message"]
                await c.assert_idle_and_conserved()
                body["ttft_slo_ms"] = 600_000.0  # ten minutes: met
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                body["priority"] = 5000
                assert (await client.post("/v1/completions", json=body)).status_code == 400
            m = (await asyncio.to_thread(c.metrics))[1]
            assert m["pdserve_ttft_prediction_error_seconds_count"] >= 1
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def test_colocated_node_default_target_refuses_and_conserves() -> None:
    """The node's --ttft-slo-ms applies to requests that set none (colocated: the prompt is
    prefilled by the node's own engine, measured the same way)."""

    async def body() -> None:
        overrides = {"ttft_slo_ms": 1.0}
        async with pd_cluster(MODEL, colocated=True, decode_overrides=overrides) as c:
            await _warm(c)  # no rate yet: served
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(c.targets[0], PROMPT, max_tokens=4, request_id="co", timeout=60)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert int(dict(err.value.trailing_metadata())["retry-after"]) >= 1
            _never_created(c, "co")
            # its own looser target wins over the node's
            ok = await _grpc_served(c, _grpc_request("co-loose", ttft_slo_ms=600_000))
            assert ok
            await c.assert_idle_and_conserved()

    asyncio.run(body())


async def _grpc_served(c: PdCluster, request: generation_pb2.GenerateRequest) -> bool:
    channel = create_channel(c.targets[0])
    try:
        stub = generation_pb2_grpc.GenerationStub(channel)
        finishes = [r.finish_reason async for r in stub.Generate(request, timeout=60)]
        return finishes[-1] != generation_pb2.FINISH_REASON_UNSPECIFIED
    finally:
        await channel.close()


async def _seats_used(c: PdCluster, prompts: list[list[int]]) -> set[int]:
    """Run the prompts at once; the seats (sequence slots) they held. Seats are handed out
    lowest first, so requests that never share the batch all hold seat 0."""
    await asyncio.gather(
        *(
            generate(
                c.targets[0], p, max_tokens=8, ignore_eos=True, request_id=f"span-{i}", timeout=60
            )
            for i, p in enumerate(prompts)
        )
    )
    history = c.decodes[0].core.recent_history
    return {s for rid, h in history if rid.startswith("span-") for _, s in h if s is not None}


def test_colocated_itl_bound_holds_new_prompts_out_of_a_running_batch() -> None:
    """A colocated node whose --itl-slo-ms no measured step meets: once a step time is measured,
    a prompt arriving beside a running request waits (QUEUED, holding nothing) until that one
    is done, so the three requests never share the batch; without a target they do. Every seat
    and block comes back either way."""
    prompts = random_prompts(3, 256, min_len=40, max_len=40, seed=907)

    async def body(itl_slo_ms: float | None) -> set[int]:
        overrides = {"itl_slo_ms": itl_slo_ms}
        async with pd_cluster(MODEL, colocated=True, decode_overrides=overrides) as c:
            await generate(c.targets[0], PROMPT, max_tokens=8, ignore_eos=True, timeout=60)
            seats = await _seats_used(c, prompts)
            await c.assert_idle_and_conserved()
            return seats

    assert asyncio.run(body(0.001)) == {0}
    assert len(asyncio.run(body(None))) > 1
