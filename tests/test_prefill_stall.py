"""A prefill node stalled (SIGSTOP) while its pushes are in flight, under concurrent load.

The decode node gives up on those transfers while the prefill node cannot run. Once it runs
again, the prefill node must let go of everything the abandoned pushes held by the decode node's
deadline (plus the bounded wait for UCX to stop reading), on its own: nothing pinned, no request
left in any DISAGG_* state, on either node, without a restart.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from pdserve.client import generate
from pdserve.cluster import NodeProcess, stop_all
from proto.pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from shared.engine.config import EngineConfig
from shared.engine.requests.request import LlmRequestState
from shared.engine.sampling.sampling_params import SamplingParams
from shared.serving.limits import PUSH_QUIESCE_S
from shared.serving.wire import sampling_to_proto
from tests.engine_helpers import random_prompts
from tests.support.cluster import pd_cluster
from tests.test_faults import VOCAB, Nodes, metrics, target, wait_released

KV_TIMEOUT_S = 3.0  # the decode node's --kv-transfer-timeout: each transfer's deadline
PREFILL_TIMEOUT_S = 3.0  # its --prefill-timeout: the Prefill call's gRPC deadline
STALL_S = 3.0  # past every deadline of the transfers in flight when the node stopped
IN_PUSH = 'pdserve_requests{state="DISAGG_CONTEXT_TRANS_IN_PROGRESS"}'


async def until_pushing(node: NodeProcess, timeout: float = 60.0) -> None:
    """Returns once a request on `node` has its context computed and its push under way or
    done (its blocks pinned until the prefill node releases it), while the engine goes on
    with the next step of the other prompts."""
    deadline = time.monotonic() + timeout
    while (await asyncio.to_thread(metrics, node)).get(IN_PUSH, 0.0) < 1:
        assert time.monotonic() < deadline, "the prefill node never pushed a request"
        await asyncio.sleep(0.005)


def disagg_requests(node: NodeProcess) -> dict[str, float]:
    prefix = 'pdserve_requests{state="DISAGG_'
    return {k: v for k, v in metrics(node).items() if k.startswith(prefix) and v}


def test_prefill_stalled_mid_transfer_releases_everything_by_its_deadline() -> None:
    nodes = Nodes()
    try:
        stall_under_load(nodes)
    finally:
        for node in nodes.all:
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGCONT)
        stop_all(nodes.all, grace=10)


def stall_under_load(nodes: Nodes) -> None:
    p = nodes.prefill()
    d = nodes.decode(
        [p], "--kv-transfer-timeout", str(KV_TIMEOUT_S), "--prefill-timeout", str(PREFILL_TIMEOUT_S)
    )
    # a short prompt first, then ~3 engine steps of long ones (8192 tokens a step): the first
    # requests finish early and wait for a long step to end before the engine releases them;
    # the stall lands there
    prompts = [
        *random_prompts(1, VOCAB, min_len=200, max_len=200, seed=30),
        *random_prompts(14, VOCAB, min_len=1600, max_len=2000, seed=31),
    ]

    async def wave() -> list[object]:
        calls = [
            asyncio.ensure_future(generate(target(d), q, max_tokens=4, timeout=60)) for q in prompts
        ]
        try:
            await until_pushing(p)
            await asyncio.sleep(0.05)  # its few KV messages sent: its handler releases it
            p.proc.send_signal(signal.SIGSTOP)
            # the clients give up while the node is stopped, and the decode node with them:
            # every Prefill call still open is cancelled, every transfer's deadline passes
            for call in calls:
                call.cancel()
            await asyncio.sleep(STALL_S)
        finally:
            p.proc.send_signal(signal.SIGCONT)
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(wave())
    assert any(isinstance(r, asyncio.CancelledError) for r in results)
    # traffic is over: the prefill node releases by its own deadline (already past) plus the
    # bounded wait for UCX to stop reading, and an engine step or two
    try:
        wait_released(p, d, timeout=PUSH_QUIESCE_S + 10)
    except AssertionError as e:
        raise AssertionError(f"{e}; prefill node's requests: {disagg_requests(p)}") from None
    assert disagg_requests(p) == {} and disagg_requests(d) == {}
    assert metrics(p)["pdserve_kv_transfers_expired_total"] >= 1


def test_a_push_incomplete_at_the_decode_nodes_deadline_is_given_up() -> None:
    """`deadline_unix` alone (the call's gRPC deadline far off, nobody cancels): the prefill
    node gives the push up at that deadline, answers DEADLINE_EXCEEDED, counts it, and holds
    nothing afterwards; the request ends DISAGG_TRANS_ERROR."""
    # 8 tokens a step: a 4000-token prompt takes hundreds of steps, far past the deadline
    slow = EngineConfig(model="tiny", num_kv_blocks=1024, max_num_tokens=8)
    prompt = random_prompts(1, VOCAB, min_len=4000, max_len=4000, seed=5)[0]

    async def body() -> None:
        async with pd_cluster("tiny", prefill_engine=slow) as c:
            p, d = c.prefills[0], c.decodes[0]
            request = prefill_pb2.PrefillRequest(
                request_id="late",
                prompt_token_ids=prompt,
                sampling=sampling_to_proto(SamplingParams(max_tokens=1)),
                layerwise=True,
                deadline_unix=time.time() + 0.5,
                # a real KV listener, under a transfer it never issued: it drops every message
                destination=prefill_pb2.KvDestination(
                    ucx_address=d.receiver.address,
                    transfer_id=7,
                    transfer_token=bytes(16),
                    block_ids=list(range(-(-len(prompt) // p.layout.block_size))),
                    layout_fingerprint=p.layout.fingerprint(),
                ),
            )
            started = time.monotonic()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{p.port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await prefill_pb2_grpc.PrefillStub(channel).Prefill(request, timeout=60)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
            assert "deadline" in err.value.details()
            assert time.monotonic() - started < 30  # its own deadline, not the call's
            await c.assert_idle_and_conserved()
            prefill_metrics = (await asyncio.to_thread(c.metrics))[0]
            assert prefill_metrics["pdserve_kv_transfers_expired_total"] == 1
            states = [s for s, _ in dict(p.core.recent_history)["late"]]
            assert states[-1] == LlmRequestState.DISAGG_TRANS_ERROR, states

    asyncio.run(body())
