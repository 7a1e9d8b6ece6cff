"""A KV listener whose shared-memory receive queue is stuck behind a dead peer restarts itself.

Same-host UCX peers deliver through one receive FIFO per worker; a sender killed mid-write can
leave an entry that never completes and every other sender's messages wait behind it for good
(transfer.queue_check). Real UCX throughout: the receiver lives here, senders are subprocesses
(the transfer peer of tests.test_transfer).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.bench.peers.transfer_peer import dest_to_json
from shared.kv.layout import KvLayout
from shared.kv.pool import allocate_kv_pool
from tests.test_transfer import LAYOUT, Peer
from transfer import listener
from transfer.errors import TransferReset

# 2 MiB per block and layer: a 16-block push is 128 MiB of rendezvous fragments, so a kill
# lands mid-message
BIG = KvLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=256, dtype="float32")


async def _until(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def push(receiver: object, sender: Peer, dst: list[int], src: list[int]) -> int:
    """One whole-request push from `sender` that lands; returns the attempts it took. A push
    reset by the receiver, or sent on an endpoint the reset broke, is retried as the decode
    node does."""
    for attempt in range(1, 4):
        dest = receiver.expect("push", dst)
        landed = asyncio.ensure_future(receiver.wait(dest.transfer_id, 15))
        target = dest_to_json(dest)
        reply = await sender.call(30, cmd="send_kv", dest=target, src_ids=src, mode="whole")
        if reply["ok"]:
            try:
                await landed
                return attempt
            except TransferReset:
                pass
        await receiver.release(dest.transfer_id, 2)
    raise AssertionError("the push never landed")


async def lose(peer: Peer, address: str) -> None:
    """`peer` connects to the receiver at `address` (one noise message), then is SIGKILLed."""
    reply = await peer.call(cmd="raw", address=address, messages=[[7, "00"]])
    assert reply["ok"], reply
    peer.proc.kill()
    await peer.proc.wait()


def assert_clean(receiver: object) -> None:
    assert receiver.describe().startswith("0 live, 0 fenced, 0 writes posted"), receiver.describe()


def test_a_stuck_queue_restarts_the_listener_on_its_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every check fails (timeout 0: a stuck queue on demand). A peer's death restarts the
    listener: the transfer in flight fails with TransferReset (the retryable kind), the
    address stays, and the surviving sender's next push lands on the new worker."""
    from transfer.ucx import KvReceiver

    monkeypatch.setattr(listener, "QUEUE_CHECK_TIMEOUT_S", 0.0)

    async def main() -> None:
        receiver = KvReceiver(allocate_kv_pool(LAYOUT, 24, "cpu"), LAYOUT)
        await receiver.start()
        sender, doomed = await Peer.spawn("sender"), await Peer.spawn("sender")
        try:
            address = receiver.address
            assert await push(receiver, sender, [0, 1], [2, 3]) == 1
            dest = receiver.expect("in flight", [4, 5])
            in_flight = asyncio.ensure_future(receiver.wait(dest.transfer_id, 30))
            await lose(doomed, address)
            with pytest.raises(TransferReset, match="restarted"):
                await asyncio.wait_for(in_flight, 10)
            assert receiver.listener_restarts == 1 and receiver.address == address
            await receiver.release(dest.transfer_id, 2)
            assert await push(receiver, sender, [6, 7], [1, 2]) <= 2
            assert_clean(receiver)
        finally:
            await sender.stop()
            await receiver.close()

    asyncio.run(main())


def test_a_peer_lost_while_the_queue_moves_restarts_nothing() -> None:
    """The check runs once per peer loss, passes, and its own connection's closing is not
    taken for another loss; a transfer in flight goes on."""
    from transfer.ucx import KvReceiver

    async def main() -> None:
        receiver = KvReceiver(allocate_kv_pool(LAYOUT, 24, "cpu"), LAYOUT)
        await receiver.start()
        sender, doomed = await Peer.spawn("sender"), await Peer.spawn("sender")
        try:
            dest = receiver.expect("in flight", [4, 5])
            in_flight = asyncio.ensure_future(receiver.wait(dest.transfer_id, 30))
            await lose(doomed, receiver.address)
            check = receiver._net.check  # the listener's QueueCheck (not public API)
            await _until(lambda: check.checks == 1 and not check.sources, 10)
            await asyncio.sleep(0.5)  # a second check would have started by now
            assert check.checks == 1 and receiver.listener_restarts == 0
            messages = [[layer, [1, 2], [4, 5]] for layer in range(LAYOUT.num_layers)]
            sent = sender.call(cmd="send", dest=dest_to_json(dest), messages=messages, last=True)
            assert (await sent)["ok"]
            await asyncio.wait_for(in_flight, 10)
            assert_clean(receiver)
        finally:
            await sender.stop()
            await receiver.close()

    asyncio.run(main())


def test_senders_killed_mid_push_never_stall_another_senders_push() -> None:
    """The failure this guards against, as it happens: SIGKILL a sender part-way through a
    128 MiB push, then push from another sender. Without the check about 1 kill in 20 (under
    load) left that push stuck until its deadline; with it each lands, at worst after a
    restart (~2 s)."""
    from transfer.ucx import KvReceiver

    rng = random.Random(3)

    async def main() -> None:
        receiver = KvReceiver(allocate_kv_pool(BIG, 24, "cpu"), BIG)
        await receiver.start()
        # every sender started up front, side by side (a start is ~2 s, mostly imports); a
        # victim connects to the receiver only when told to push
        spawned = await asyncio.gather(
            Peer.spawn("sender", BIG, 4),
            *(Peer.spawn("sender", BIG, 16) for _ in range(5)),
            return_exceptions=True,
        )
        peers = [p for p in spawned if isinstance(p, Peer)]
        try:
            for p in spawned:
                if isinstance(p, BaseException):
                    raise p
            bystander, *victims = peers
            for victim in victims:
                dest = receiver.expect("victim", list(range(16)))
                doomed = asyncio.ensure_future(receiver.wait(dest.transfer_id, 60))
                target, every = dest_to_json(dest), list(range(16))
                victim.post(cmd="send_kv", dest=target, src_ids=every, mode="whole")
                await _until(lambda d=doomed: receiver.writes_in_flight > 0 or d.done(), 20)
                await asyncio.sleep(rng.uniform(0.0, 0.05))
                victim.proc.kill()
                await victim.proc.wait()
                started = time.monotonic()
                await push(receiver, bystander, [20, 21], [1, 2])
                assert time.monotonic() - started < 10
                await receiver.release(dest.transfer_id, 2)
                doomed.cancel()
            assert_clean(receiver)
        finally:
            for peer in peers:  # the bystander, and any victim a failure left alive
                await peer.stop()
            await receiver.close()

    asyncio.run(main())


def test_a_listener_restart_asks_the_same_prefill_node_again(
    checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a cluster (in-process nodes, the only prefill node on this host): a restart of the
    decode node's KV listener (forced: every check fails) while a prompt's KV is in flight
    resets that transfer; the decode node asks the same prefill node again, under a new attempt
    id (the abandoned attempt may still hold the plain one there), with the same tokens."""
    import numpy as np
    from prometheus_client import generate_latest

    from pdserve.client import generate
    from shared.engine.config import EngineConfig
    from shared.serving.metrics import parse_prometheus_text
    from tests.engine_helpers import hf_greedy, random_prompts
    from tests.support.cluster import pd_cluster
    from transfer.protocol import split_address
    from transfer.worker import UcxWorker

    monkeypatch.setattr(listener, "QUEUE_CHECK_TIMEOUT_S", 0.0)
    path = checkpoint("llama", num_hidden_layers=3)
    prompt = random_prompts(1, 512, min_len=1000, max_len=1000, seed=45)[0]
    slow = EngineConfig(model=str(path), num_kv_blocks=1024, max_num_tokens=8)  # 125 chunks

    async def lose_a_peer(address: str) -> None:
        """A UCX peer of the receiver that connects, sends noise and goes."""
        worker = UcxWorker(asyncio.get_running_loop())
        endpoint = worker.connect(*split_address(address))
        await worker.send(endpoint, np.zeros(8, dtype=np.uint8), 99)
        await asyncio.wait({worker.close_endpoint(endpoint)}, timeout=2)
        worker.close()

    async def body() -> None:
        async with pd_cluster(path, prefill_engine=slow) as c:
            receiver = c.decodes[0].receiver
            core = c.prefills[0].thread.core
            step = core.step

            def step_after_the_restart() -> list:
                # the prompt's prefill waits for the restart, so that its transfer is in flight
                # when the restart comes: with fast enough kernels 125 chunks could finish first
                deadline = time.monotonic() + 30
                while receiver.listener_restarts == 0 and time.monotonic() < deadline:
                    time.sleep(0.005)
                return step()

            core.step = step_after_the_restart
            answer = asyncio.ensure_future(generate(c.targets[0], prompt, max_tokens=4, timeout=60))
            await _until(lambda: receiver.live_transfers == 1, 30)
            await lose_a_peer(receiver.address)
            got = await answer
            assert receiver.listener_restarts == 1 and receiver.failed_total == 1  # the reset
            scraped = generate_latest(c.decodes[0].metrics.registry).decode()
            assert parse_prometheus_text(scraped)["pdserve_kv_listener_restarts_total"] == 1
            assert got.token_ids == hf_greedy(path, prompt, 4)
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def test_attempt_ids_are_distinct_and_within_the_request_id_limit() -> None:
    from decode_node.remote_prefill import attempt_id
    from shared.serving.limits import MAX_REQUEST_ID_CHARS
    from shared.serving.wire import check_request_id

    assert attempt_id("r", 0) == "r" and attempt_id("r", 1) == "r#1" != attempt_id("r", 2)
    longest = "x" * MAX_REQUEST_ID_CHARS
    ids = {attempt_id(longest, n) for n in range(3)}
    assert len(ids) == 3
    for rid in ids:
        check_request_id(rid)  # what the prefill node checks


def test_a_check_that_cannot_reach_its_listener_is_no_evidence() -> None:
    """A queue check whose send fails (nothing listens there: a configuration the check cannot
    judge) does not call the queue stuck, so it never restarts a listener for it."""
    import socket

    from transfer.queue_check import QueueCheck
    from transfer.worker import UcxWorker

    async def main() -> None:
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        worker = UcxWorker(asyncio.get_running_loop())
        try:
            check = QueueCheck(worker, timeout=10.0)
            started = time.monotonic()
            assert not await check.stuck("127.0.0.1", port)
            assert time.monotonic() - started < 5  # the failed send ends it, not the timeout
        finally:
            worker.close()

    asyncio.run(main())
