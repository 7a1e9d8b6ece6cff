"""KV transfer plane over real UCX, two processes: the receiver (decode side) lives in this process
on its own event loop; senders run in fresh interpreters (the transfer peer the benchmarks use,
pdserve/bench/peers/transfer_peer.py), because a process that forks after UCX is initialised breaks
its children."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import torch

from pdserve.bench.peers.transfer_peer import dest_from_json, dest_to_json, sender_pool
from pdserve.bench.support.util import REPLY_PREFIX
from shared.kv.layout import KvLayout
from shared.kv.pool import allocate_kv_pool
from transfer import protocol
from transfer.errors import TransferCancelled, TransferError, TransferTimeout
from transfer.protocol import TransferDestination

T = TypeVar("T")
LAYOUT = KvLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
SENDER_BLOCKS = 16
RECEIVER_BLOCKS = 24
BLOCK_BYTES = LAYOUT.block_bytes_per_layer


# ---- pure protocol ---------------------------------------------------------------------------
def test_header_round_trip_and_alignment() -> None:
    token = secrets.token_bytes(16)
    fp = protocol.fingerprint_bytes(LAYOUT.fingerprint())
    ids = (7, 3, 200_000, 0)
    raw = protocol.encode_header(2**64 - 1, token, fp, 2, ids, 4 * BLOCK_BYTES, last=True)
    assert len(raw) == protocol.header_size(len(ids)) and len(raw) % 64 == 0
    prefix = protocol.decode_prefix(raw)
    assert (prefix.transfer_id, prefix.token, prefix.layer, prefix.n_blocks) == (
        2**64 - 1,
        token,
        2,
        4,
    )
    assert prefix.last and prefix.payload_bytes == 4 * BLOCK_BYTES
    assert protocol.decode_block_ids(raw, prefix) == ids
    assert [protocol.header_size(n) for n in (0, 1, 16, 17)] == [64, 128, 128, 192]
    with pytest.raises(protocol.ProtocolError) as bad:
        protocol.decode_prefix(b"XXXX" + raw[4:])
    assert bad.value.reason == protocol.REJECT_BAD_HEADER


def test_destination_validation() -> None:
    dest = TransferDestination("10.0.0.1:5000", 5, b"x" * 16, [1, 2], "fp")  # type: ignore[arg-type]
    assert dest.block_ids == (1, 2) and hash(dest)
    assert protocol.split_address("[::1]:70") == ("::1", 70)
    for bad in (("nohost", 1, b"x" * 16), ("h:1", -1, b"x" * 16), ("h:1", 1, b"short")):
        with pytest.raises(ValueError):
            TransferDestination(bad[0], bad[1], bad[2], (1,), "fp")


# ---- harness: receiver here, peers in subprocesses ---------------------------------------------
class Peer:
    def __init__(self, proc: asyncio.subprocess.Process, first: dict[str, Any]) -> None:
        self.proc = proc
        self.first = first

    @classmethod
    async def spawn(
        cls, role: str, layout: KvLayout = LAYOUT, num_blocks: int = SENDER_BLOCKS
    ) -> Peer:
        """A peer with a pool of `num_blocks` blocks of `layout` (a sender's: `sender_pool`)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pdserve.bench.peers.transfer_peer",
            "--role",
            role,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        peer = cls(proc, {})
        setup = {"layout": dataclasses.asdict(layout), "num_blocks": num_blocks}
        if role == "sender":
            setup["fill"] = "random"
        peer.first = await peer.call(30, cmd="setup", **setup)
        return peer

    def post(self, **cmd: Any) -> None:
        """Send a command without waiting for its reply (one that stops the peer)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())

    async def call(self, timeout: float = 20, **cmd: Any) -> dict[str, Any]:
        self.post(**cmd)
        assert self.proc.stdin is not None
        await self.proc.stdin.drain()
        return await self._reply(timeout)

    async def _reply(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
            if not line:
                raise RuntimeError(f"peer exited with {await self.proc.wait()}")
            text = line.decode(errors="replace")
            if text.startswith(REPLY_PREFIX):
                return json.loads(text[len(REPLY_PREFIX) :])

    async def stop(self) -> None:
        if self.proc.returncode is None:
            try:
                await self.call(timeout=10, cmd="quit")
                await asyncio.wait_for(self.proc.wait(), 10)
            except (RuntimeError, TimeoutError, BrokenPipeError, ConnectionResetError):
                pass
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)


class Harness:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pool = allocate_kv_pool(LAYOUT, RECEIVER_BLOCKS, "cpu")
        gen = torch.Generator().manual_seed(99)
        self.pool.copy_(torch.randn(self.pool.shape, generator=gen))  # not zeros: see "untouched"
        self.source = sender_pool(LAYOUT, SENDER_BLOCKS)
        from transfer.ucx import KvReceiver

        self.receiver = KvReceiver(self.pool, LAYOUT)
        self.run(self.receiver.start())
        self.sender = self.run(Peer.spawn("sender"))

    def run(self, aw: Awaitable[T], timeout: float = 60) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(aw, timeout))

    async def send(self, dest: TransferDestination, messages: list, **kw: Any) -> dict[str, Any]:
        return await self.sender.call(cmd="send", dest=dest_to_json(dest), messages=messages, **kw)

    async def raw(self, *messages: tuple[int, bytes]) -> dict[str, Any]:
        """Send (tag, bytes) messages from the peer, back to back, as they are."""
        reply = await self.sender.call(
            cmd="raw",
            address=self.receiver.address,
            messages=[[tag, data.hex()] for tag, data in messages],
        )
        assert reply["ok"], reply
        await self.settle()
        return reply

    async def settle(self, seconds: float = 0.1) -> None:
        """Let the receiver's loop process whatever the peer just sent."""
        await asyncio.sleep(seconds)

    def close(self) -> None:
        self.run(self.sender.stop())
        self.run(self.receiver.close())
        self.loop.close()


@pytest.fixture(scope="module")
def h() -> Iterator[Harness]:
    harness = Harness()
    try:
        yield harness
    finally:
        harness.close()


def forged(
    dest: TransferDestination,
    *,
    layer: int = 0,
    ids: tuple[int, ...] | None = None,
    token: bytes | None = None,
    transfer_id: int | None = None,
    payload_bytes: int | None = None,
    seq: int = 0,
) -> tuple[int, bytes]:
    """A KV header built by hand, any field overridable: (tag, bytes)."""
    ids = ids if ids is not None else dest.block_ids[:1]
    header = protocol.encode_header(
        dest.transfer_id if transfer_id is None else transfer_id,
        dest.token if token is None else token,
        protocol.fingerprint_bytes(dest.layout_fingerprint),
        layer,
        ids,
        len(ids) * BLOCK_BYTES if payload_bytes is None else payload_bytes,
        seq=seq,
    )
    return dest.transfer_id, header


def payload(dest: TransferDestination, seq: int, nbytes: int, token: bytes | None = None):
    """A payload message for header `seq` (tag derived from the token): (tag, bytes)."""
    tag = protocol.payload_tag(dest.token if token is None else token, dest.transfer_id, seq)
    return tag, os.urandom(nbytes)


def snapshot(pool: torch.Tensor) -> torch.Tensor:
    return pool.clone()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (pools may hold NaNs from random payloads)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---- the transfer path ------------------------------------------------------------------------
def test_round_trip_chunked_non_contiguous(h: Harness) -> None:
    dst = [17, 3, 9, 21, 5, 12, 0]  # decode-side blocks, prompt order, scattered
    src = [2, 5, 6, 7, 11, 12, 15]  # prefill-side blocks
    chunks = [(0, 3), (3, 4), (4, 7)]  # chunked prefill: 3 chunks finish 3, 1, 3 blocks
    before = snapshot(h.pool)
    layers_done: list[int] = []

    async def main() -> Any:
        dest = h.receiver.expect("req-rt", dst, on_layer=layers_done.append)
        messages = [
            [layer, src[a:b], dst[a:b]] for a, b in chunks for layer in range(LAYOUT.num_layers)
        ]
        landed = asyncio.ensure_future(h.receiver.wait(dest.transfer_id, 20))
        reply = await h.send(dest, messages)
        assert reply["ok"], reply
        return await landed, reply

    stats, reply = h.run(main())
    assert layers_done == [0, 1, 2]
    assert stats.bytes == len(dst) * LAYOUT.num_layers * BLOCK_BYTES
    assert stats.messages == len(chunks) * LAYOUT.num_layers
    assert all(t is not None for t in stats.layer_completed_at)
    assert stats.first_message_at <= stats.last_message_at <= stats.completed_at
    assert reply["bytes"] == stats.bytes and reply["wire"] > stats.bytes  # + the headers
    for layer in range(LAYOUT.num_layers):
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(h.pool[layer][:, d], h.source[layer][:, s])
    untouched = [b for b in range(RECEIVER_BLOCKS) if b not in dst]
    assert same(h.pool[:, :, untouched], before[:, :, untouched])


def test_noise_is_dropped_and_the_transfer_goes_on(h: Harness) -> None:
    """Messages without the transfer's token: counted, never written, transfer unaffected."""

    async def main() -> None:
        dest = h.receiver.expect("req-noise", [1, 2, 4])
        before = snapshot(h.pool)
        counts = dict(h.receiver.rejected_by_reason)
        tid = dest.transfer_id
        forged_token = secrets.token_bytes(16)
        await h.raw(forged(dest, token=forged_token))  # forged token
        await h.raw(payload(dest, 0, BLOCK_BYTES, token=forged_token))  # its payload: no tag
        await h.raw(forged(dest, transfer_id=tid ^ 1))  # header names another transfer
        await h.raw((secrets.randbits(64), forged(dest)[1]))  # tag of no transfer
        await h.raw((tid, os.urandom(100)))  # garbage on the right tag
        await h.raw((secrets.randbits(64), os.urandom(5000)))  # garbage anywhere
        await h.raw((tid, b"tiny"))  # shorter than any header
        await h.raw((tid, os.urandom(1 << 20)))  # larger than any header of this transfer
        assert same(h.pool, before)
        assert _delta(counts, h.receiver.rejected_by_reason) == {
            protocol.REJECT_BAD_TOKEN: 1,
            protocol.REJECT_UNKNOWN_TRANSFER: 4,
            protocol.REJECT_BAD_HEADER: 1,
            protocol.REJECT_BAD_LENGTH: 2,
        }
        messages = [[layer, [0, 1, 2], [1, 2, 4]] for layer in range(LAYOUT.num_layers)]
        landed = asyncio.ensure_future(h.receiver.wait(tid, 20))
        assert (await h.send(dest, messages))["ok"]
        await landed
        assert torch.equal(h.pool[:, :, [1, 2, 4]], h.source[:, :, [0, 1, 2]])

    total = h.receiver.rejected_total
    h.run(main())
    assert h.receiver.rejected_total == total + 8


def test_payload_before_its_header_waits_for_it(h: Harness) -> None:
    """UCX may deliver a payload ahead of its header (another lane): it is held, not dropped,
    and lands once the header is validated."""

    async def main() -> None:
        dest = h.receiver.expect("req-early", [8, 9])
        landed = asyncio.ensure_future(h.receiver.wait(dest.transfer_id, 20))
        body = [payload(dest, seq, 2 * BLOCK_BYTES) for seq in range(LAYOUT.num_layers)]
        heads = [
            forged(dest, layer=layer, ids=(8, 9), seq=layer) for layer in range(LAYOUT.num_layers)
        ]
        await h.raw(*body[:2], heads[1], heads[0], heads[2], body[2])
        stats = await landed
        assert stats.messages == LAYOUT.num_layers
        for layer, (_, data) in enumerate(body):
            got = h.pool[layer][:, [8, 9]].contiguous().view(torch.uint8).numpy().tobytes()
            assert got == data  # bytes: random payloads hold NaNs

    h.run(main())


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.001)


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("block_outside_reservation", protocol.REJECT_BAD_BLOCK),
        ("wrong_byte_count", protocol.REJECT_BAD_LENGTH),
        ("duplicate_block", protocol.REJECT_DUPLICATE),
        ("bad_layer", protocol.REJECT_BAD_LAYER),
        ("seq_reused", protocol.REJECT_BAD_SEQ),
        ("seq_far_ahead", protocol.REJECT_BAD_SEQ),
        ("payload_size", protocol.REJECT_BAD_LENGTH),
    ],
)
def test_bad_data_from_the_sender_fails_the_transfer(h: Harness, case: str, reason: str) -> None:
    """Malformed messages with the right token come from a broken sender: rejected, counted,
    not written, and the transfer fails at once; the next transfer is unaffected."""

    async def main() -> None:
        dest = h.receiver.expect(f"req-{case}", [6, 7])
        landed = asyncio.ensure_future(h.receiver.wait(dest.transfer_id, 20))
        if case in ("duplicate_block", "seq_reused"):
            received = h.receiver.bytes_received_total
            assert (await h.send(dest, [[0, [3], [6]]]))["ok"]  # seq 0: layer 0, block 6
            # the payload's receive completes after the send: wait until it has landed
            await asyncio.wait_for(_until(lambda: h.receiver.bytes_received_total > received), 10)
        before = snapshot(h.pool)
        counts = dict(h.receiver.rejected_by_reason)
        messages = {
            "block_outside_reservation": lambda: [forged(dest, ids=(6, 8))],
            "wrong_byte_count": lambda: [forged(dest, payload_bytes=BLOCK_BYTES - 4)],
            "duplicate_block": lambda: [forged(dest, ids=(6,), seq=1)],
            "bad_layer": lambda: [forged(dest, layer=LAYOUT.num_layers)],
            "seq_reused": lambda: [forged(dest, ids=(7,), seq=0)],
            "seq_far_ahead": lambda: [forged(dest, ids=(7,), seq=10_000)],
            "payload_size": lambda: [forged(dest, ids=(7,)), payload(dest, 0, BLOCK_BYTES - 4)],
        }[case]()
        await h.raw(*messages)
        with pytest.raises(TransferError, match=reason):
            await landed
        assert same(h.pool, before)
        assert _delta(counts, h.receiver.rejected_by_reason) == {reason: 1}
        await _valid_transfer(h, [6, 7])

    h.run(main())


def test_timeout_fires_without_sender_and_late_message_is_dropped(h: Harness) -> None:
    async def main() -> None:
        dest = h.receiver.expect("req-late", [10, 11])
        before = snapshot(h.pool)
        started = time.monotonic()
        with pytest.raises(TransferTimeout, match="6 of 6"):
            await h.receiver.wait(dest.transfer_id, 0.3)
        assert 0.25 < time.monotonic() - started < 2
        late = h.receiver.rejected_by_reason.get(protocol.REJECT_LATE, 0)
        reply = await h.send(dest, [[0, [0, 1], [10, 11]]])
        assert reply["ok"], reply  # drained by the receiver: the sender is not left hanging
        await h.settle()
        assert h.receiver.rejected_by_reason[protocol.REJECT_LATE] == late + 2  # header, payload
        assert same(h.pool, before)
        await _valid_transfer(h, [10, 11])  # no stale receive swallows the next transfer

    h.run(main())


def test_cancel(h: Harness) -> None:
    async def main() -> None:
        dest = h.receiver.expect("req-cancel", [13])
        waiter = asyncio.ensure_future(h.receiver.wait(dest.transfer_id, 20))
        await asyncio.sleep(0.05)
        h.receiver.cancel(dest.transfer_id)
        h.receiver.cancel(dest.transfer_id)  # idempotent
        with pytest.raises(TransferCancelled):
            await waiter
        before = snapshot(h.pool)
        late = h.receiver.rejected_by_reason.get(protocol.REJECT_LATE, 0)
        assert (await h.send(dest, [[0, [0], [13]]]))["ok"]
        await h.settle()
        assert h.receiver.rejected_by_reason[protocol.REJECT_LATE] == late + 2  # header, payload
        assert same(h.pool, before)
        h.receiver.cancel(12345)  # unknown: ignored

    h.run(main())


def test_idle_listener_does_not_spin(h: Harness) -> None:
    """A listener with a connected peer and a transfer expected but not arriving stays idle."""

    async def main() -> float:
        dest = h.receiver.expect("req-idle", [14])
        await asyncio.sleep(0.2)
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(2.0)
        used = (time.process_time() - cpu) / (time.monotonic() - wall)
        h.receiver.cancel(dest.transfer_id)
        return used

    used = h.run(main())
    assert used < 0.05, f"idle receiver used {used:.1%} of a core"


def test_sender_sees_decode_death_quickly(h: Harness) -> None:
    from transfer.ucx import KvMessage, KvSender

    everything = list(range(SENDER_BLOCKS))  # 16 blocks: one message is rendezvous-sized

    async def main() -> None:
        decode = await Peer.spawn("receiver")
        sender = KvSender(LAYOUT)
        try:
            reply = await decode.call(cmd="expect", block_ids=everything)
            dest = dest_from_json(reply["dest"])
            push = sender.open(dest)
            payload = KvSender.pack(h.source, 0, everything)
            message = KvMessage(layer=0, blocks=everything, payload=payload)
            assert await push.send(message) >= 8192  # rendezvous
            # Stopped, not dead: the message is not taken, and the send's deadline says so;
            # meanwhile the sender sleeps instead of spinning on the stalled request.
            decode.signal(signal.SIGSTOP)
            payload = KvSender.pack(h.source, 1, everything)
            cpu, wall = time.process_time(), time.monotonic()
            with pytest.raises(TransferTimeout):
                await push.send(KvMessage(layer=1, blocks=everything, payload=payload), timeout=1.0)
            stalled_cpu = (time.process_time() - cpu) / (time.monotonic() - wall)
            assert stalled_cpu < 0.2, f"stalled send used {stalled_cpu:.0%} of a core"
            # A send pending while the process dies fails within a few seconds.
            payload = KvSender.pack(h.source, 2, everything)
            message = KvMessage(layer=2, blocks=everything, payload=payload)
            pending = asyncio.ensure_future(push.send(message))
            await asyncio.sleep(0.3)
            assert not pending.done()
            decode.signal(signal.SIGKILL)
            await decode.proc.wait()
            died = time.monotonic()
            with pytest.raises(TransferError) as pending_error:
                await pending
            assert not isinstance(pending_error.value, TransferTimeout)
            assert time.monotonic() - died < 3
            # The broken endpoint was dropped; reconnecting to a dead node fails fast too.
            started = time.monotonic()
            with pytest.raises(TransferError):
                payload = KvSender.pack(h.source, 0, [2])
                await push.send(KvMessage(layer=0, blocks=[2], payload=payload))
            assert time.monotonic() - started < 3
        finally:
            await sender.close()
            await decode.stop()

    h.run(main())


def test_stalled_sender_mid_payload_holds_the_fence_until_endpoints_reset(h: Harness) -> None:
    """A payload receive already posted into the pool cannot be cancelled; if its sender stops
    half-way, the transfer's blocks stay fenced (not reusable) until `release` force-closes
    the KV endpoints, which ends the receive. The receiver then serves new transfers."""
    from transfer.ucx import KvMessage, KvReceiver, KvSender, TransferReset

    big = KvLayout(num_layers=1, num_kv_heads=8, head_dim=128, block_size=256, dtype="float32")
    nbytes = 4 * big.block_bytes_per_layer  # 8 MiB: rendezvous, many fragments

    async def main() -> None:
        pool = allocate_kv_pool(big, 8, "cpu")
        receiver = KvReceiver(pool, big)
        await receiver.start()
        stalled = await Peer.spawn("sender")
        try:
            dest = receiver.expect("fenced", [0, 1, 2, 3])
            landed = asyncio.ensure_future(receiver.wait(dest.transfer_id, 60))
            header = protocol.encode_header(
                dest.transfer_id,
                dest.token,
                protocol.fingerprint_bytes(big.fingerprint()),
                0,
                (0, 1, 2, 3),
                nbytes,
                last=True,
            )
            body = payload(dest, 0, nbytes)
            stalled.post(
                cmd="stall",
                address=receiver.address,
                messages=[[dest.transfer_id, header.hex()], [body[0], body[1].hex()]],
            )
            await asyncio.wait_for(_until(lambda: receiver.writes_in_flight == 1), 20)
            receiver.cancel(dest.transfer_id)
            with pytest.raises(TransferCancelled):
                await landed
            fence = receiver.quiesced(dest.transfer_id)
            await asyncio.sleep(0.3)
            assert not fence.done() and receiver.fenced_transfers == 1  # still being written
            # another transfer in flight: the reset may discard its messages, so it fails now
            # (TransferReset, its sender not at fault) instead of waiting out its deadline
            bystander = receiver.expect("bystander", [6, 7])
            waiting = asyncio.ensure_future(receiver.wait(bystander.transfer_id, 60))
            started = time.monotonic()
            await receiver.release(dest.transfer_id, timeout=0.5)
            assert fence.done() and receiver.fenced_transfers == 0
            assert receiver.endpoint_resets == 1 and receiver.writes_in_flight == 0
            with pytest.raises(TransferReset):
                await asyncio.wait_for(waiting, 1)
            assert time.monotonic() - started < 3
            assert "0 live, 0 fenced, 0 writes posted" in receiver.describe()
            # the receiver keeps serving: a healthy sender's transfer lands
            source = allocate_kv_pool(big, 4, "cpu")
            source.copy_(torch.randn(source.shape))
            sender = KvSender(big)
            try:
                dest = receiver.expect("after", [5, 6])
                landed = asyncio.ensure_future(receiver.wait(dest.transfer_id, 20))
                push = sender.open(dest, source)
                await push.send(KvMessage(layer=0, blocks=[5, 6], src=[1, 2], last=True))
                await landed
                assert same(pool[:, :, [5, 6]], source[:, :, [1, 2]])
            finally:
                await sender.close()
        finally:
            stalled.signal(signal.SIGCONT)
            stalled.proc.kill()
            await stalled.proc.wait()
            await receiver.close()

    h.run(main())


def test_sender_refuses_layout_mismatch(h: Harness) -> None:
    from transfer.ucx import KvSender

    other = KvLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
    dest = TransferDestination("127.0.0.1:1", 1, b"t" * 16, (0,), other.fingerprint())

    async def main() -> None:
        sender = KvSender(LAYOUT)
        with pytest.raises(TransferError, match="layout mismatch"):
            sender.open(dest)
        await sender.close()

    h.run(main())


def test_same_process_under_uvloop() -> None:
    """Both ends on one uvloop loop (the nodes run uvloop): a raising on_layer callback is
    logged, not fatal; `last` with blocks missing fails at once; a closed sender refuses."""
    import uvloop

    from transfer.ucx import KvMessage, KvReceiver, KvSender

    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
    pool = allocate_kv_pool(layout, 8, "cpu")
    source = allocate_kv_pool(layout, 8, "cpu")
    source.copy_(torch.randn(source.shape))
    seen: list[int] = []

    def on_layer(layer: int) -> None:
        seen.append(layer)
        raise RuntimeError("a caller's bug")

    async def main() -> None:
        receiver, sender = KvReceiver(pool, layout), KvSender(layout)
        await receiver.start()
        try:
            dest = receiver.expect("uv", [5, 1, 3], on_layer=on_layer)
            landed = asyncio.ensure_future(receiver.wait(dest.transfer_id, 10))
            push = sender.open(dest)
            for layer in range(2):
                payload = KvSender.pack(source, layer, [0, 1, 2])
                message = KvMessage(layer=layer, blocks=[5, 1, 3], payload=payload, last=layer == 1)
                await push.send(message)
            stats = await landed
            assert seen == [0, 1] and stats.messages == 2
            assert torch.equal(pool[:, :, [5, 1, 3]], source[:, :, [0, 1, 2]])

            dest = receiver.expect("uv-short", [6, 7])
            landed = asyncio.ensure_future(receiver.wait(dest.transfer_id, 10))
            push = sender.open(dest)
            payload = KvSender.pack(source, 0, [0, 1])
            await push.send(KvMessage(layer=0, blocks=[6, 7], payload=payload, last=True))
            with pytest.raises(TransferError, match="last message"):
                await landed
        finally:
            await sender.close()
            await receiver.close()
        with pytest.raises(TransferError, match="closed"):
            await push.send(KvMessage(layer=0, blocks=[6], payload=KvSender.pack(source, 0, [0])))

    uvloop.run(main())


# ---- helpers ----------------------------------------------------------------------------------
async def _valid_transfer(h: Harness, dst: list[int]) -> None:
    src = list(range(len(dst)))
    dest = h.receiver.expect("req-valid", dst)
    landed = asyncio.ensure_future(h.receiver.wait(dest.transfer_id, 20))
    messages = [[layer, src, dst] for layer in range(LAYOUT.num_layers)]
    reply = await h.send(dest, messages, last=True)
    assert reply["ok"], reply
    await landed
    assert torch.equal(h.pool[:, :, dst], h.source[:, :, src])


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_one_message_for_consecutive_layers() -> None:
    """A sender with several layers ready sends them as one header + one payload; the
    receiver claims, lands and reports every layer of it."""
    import uvloop

    from transfer.ucx import KvMessage, KvReceiver, KvSender

    layout = KvLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
    pool = allocate_kv_pool(layout, 10, "cpu")
    source = allocate_kv_pool(layout, 10, "cpu")
    source.copy_(torch.randn(source.shape))
    dst, src = [7, 2, 3, 9], [0, 1, 2, 5]

    async def main() -> None:
        receiver, sender = KvReceiver(pool, layout), KvSender(layout)
        await receiver.start()
        try:
            layers: list[int] = []
            dest = receiver.expect("multi", dst, on_layer=layers.append)
            landed = asyncio.ensure_future(receiver.wait(dest.transfer_id, 10))
            push = sender.open(dest, source)
            first = push.post(KvMessage(layer=0, blocks=dst, src=src, n_layers=3))
            last = push.post(KvMessage(layer=3, blocks=dst, src=src, last=True))
            assert await first == 3 * len(dst) * layout.block_bytes_per_layer
            await last
            stats = await landed
            assert stats.messages == 2 and layers == [0, 1, 2, 3]
            assert torch.equal(pool[:, :, dst], source[:, :, src])
            with pytest.raises(ValueError, match="outside"):
                push.post(KvMessage(layer=2, blocks=dst, src=src, n_layers=3))
        finally:
            await sender.close()
            await receiver.close()

    uvloop.run(main())
