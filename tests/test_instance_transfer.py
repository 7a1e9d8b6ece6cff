"""Instance ids on the KV plane, over real UCX (the receiver here, the sender a subprocess, as in
tests/test_transfer.py): blocks granted to one prefill instance take KV stamped by that instance
only; a message stamped otherwise (a dead predecessor's, a replay, a forgery) changes nothing;
the transfers of a replaced instance fail at once; and a reservation's lease ends it whatever
its sender does, with nobody waiting."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Iterator

import pytest
import torch

from tests.test_transfer import BLOCK_BYTES, LAYOUT, SENDER_BLOCKS, Harness, same, snapshot
from transfer import protocol
from transfer.errors import TransferSenderRestarted, TransferTimeout
from transfer.protocol import TransferDestination

INSTANCE = 0x1234_5678_9ABC_DEF0  # the sender subprocess's instance id
PREDECESSOR = 0x0FED_CBA9_8765_4321  # the instance it replaced


@pytest.fixture(scope="module")
def h() -> Iterator[Harness]:
    harness = Harness()
    setup = {"layout": dataclasses.asdict(LAYOUT), "num_blocks": SENDER_BLOCKS}
    harness.run(harness.sender.call(cmd="setup", fill="random", instance_id=INSTANCE, **setup))
    try:
        yield harness
    finally:
        harness.close()


def stamped(dest: TransferDestination, instance: int, seq: int) -> list[tuple[int, bytes]]:
    """A header carrying the transfer's token, for block dest.block_ids[0] of layer 0, stamped
    by `instance` (0: unstamped), and its payload: (tag, bytes) each."""
    ids = dest.block_ids[:1]
    header = protocol.encode_header(
        dest.transfer_id,
        dest.token,
        protocol.fingerprint_bytes(dest.layout_fingerprint),
        0,
        ids,
        BLOCK_BYTES,
        seq=seq,
        instance_id=instance,
    )
    body = os.urandom(BLOCK_BYTES)
    return [
        (dest.transfer_id, header),
        (protocol.payload_tag(dest.token, dest.transfer_id, seq), body),
    ]


def test_a_header_round_trips_its_instance_stamp() -> None:
    token, fp = os.urandom(16), protocol.fingerprint_bytes(LAYOUT.fingerprint())
    raw = protocol.encode_header(9, token, fp, 0, (3, 4), 2 * BLOCK_BYTES, instance_id=INSTANCE)
    prefix = protocol.decode_prefix(raw)
    assert prefix.stamped and len(raw) == protocol.header_size(2, instance=True)
    assert protocol.decode_instance(raw, prefix) == INSTANCE
    plain = protocol.encode_header(9, token, fp, 0, (3, 4), 2 * BLOCK_BYTES)
    assert protocol.decode_instance(plain, protocol.decode_prefix(plain)) == 0
    with pytest.raises(protocol.ProtocolError) as stale:
        protocol.validate_header(
            raw,
            transfer_id=9,
            token=token,
            layout=LAYOUT,
            fingerprint=fp,
            max_blocks=2,
            instance_id=PREDECESSOR,
        )
    assert stale.value.reason == protocol.REJECT_STALE_INSTANCE
    assert protocol.REJECT_STALE_INSTANCE in protocol.NOISE_REASONS


def test_kv_stamped_by_another_instance_changes_nothing(h: Harness) -> None:
    """With the right token, a header stamped by the predecessor, or not stamped at all, is
    rejected as noise with its payload: not a byte written, the transfer goes on and lands what
    the granted instance sends."""

    async def main() -> None:
        dest = h.receiver.expect("req-stale", [1, 2, 4], sender=INSTANCE)
        assert (dest.sender_instance, dest.receiver_instance) == (INSTANCE, h.receiver.instance_id)
        landed = asyncio.ensure_future(h.receiver.wait(dest.transfer_id, 20))
        before, rejected = snapshot(h.pool), dict(h.receiver.rejected_by_reason)
        # seqs past the ones the real sender uses: their payloads wait for a header that never
        # validates, and are drained when the transfer ends
        await h.raw(*stamped(dest, PREDECESSOR, seq=10))
        await h.raw(*stamped(dest, 0, seq=11))
        assert same(h.pool, before)
        assert not landed.done()
        got = h.receiver.rejected_by_reason
        assert (
            got[protocol.REJECT_STALE_INSTANCE] - rejected.get(protocol.REJECT_STALE_INSTANCE, 0)
            == 2
        )
        messages = [[layer, [0, 1, 2], [1, 2, 4]] for layer in range(LAYOUT.num_layers)]
        assert (await h.send(dest, messages))["ok"]
        await landed
        assert torch.equal(h.pool[:, :, [1, 2, 4]], h.source[:, :, [0, 1, 2]])

    h.run(main())


def test_a_transfer_naming_no_instance_takes_no_stamped_kv(h: Harness) -> None:
    async def main() -> None:
        dest = h.receiver.expect("req-unnamed", [5], sender=0)
        before = snapshot(h.pool)
        rejected = h.receiver.rejected_by_reason.get(protocol.REJECT_STALE_INSTANCE, 0)
        await h.raw(*stamped(dest, INSTANCE, seq=0))
        assert same(h.pool, before)
        assert h.receiver.rejected_by_reason[protocol.REJECT_STALE_INSTANCE] == rejected + 1
        h.receiver.cancel(dest.transfer_id)

    h.run(main())


def test_a_replaced_instance_has_its_transfers_failed_at_once(h: Harness) -> None:
    async def main() -> None:
        old = h.receiver.expect("req-old", [6, 7], sender=PREDECESSOR)
        new = h.receiver.expect("req-new", [8], sender=INSTANCE)
        waiting = asyncio.ensure_future(h.receiver.wait(old.transfer_id, 20))
        before = snapshot(h.pool)
        assert h.receiver.sender_restarted(PREDECESSOR, "restarted") == 1
        with pytest.raises(TransferSenderRestarted):
            await waiting
        await h.raw(*stamped(old, PREDECESSOR, seq=0))  # late: the transfer is gone
        assert same(h.pool, before)
        assert new.transfer_id in h.receiver._landings.live  # the other instance's goes on
        h.receiver.cancel(new.transfer_id)

    h.run(main())


def test_the_lease_ends_a_reservation_nobody_waits_for(h: Harness) -> None:
    """A sender that took the reservation and went silent: the transfer fails when its lease
    (from the grant) runs out, though no one ever called `wait`; its blocks are free then."""

    async def main() -> None:
        lease = 0.3
        live = h.receiver.live_transfers
        start = time.monotonic()
        dest = h.receiver.expect("req-lease", [9, 10], sender=INSTANCE, lease=lease)
        assert h.receiver.live_transfers == live + 1
        while h.receiver.live_transfers > live:
            assert time.monotonic() - start < lease + 1.0, "the lease did not end the transfer"
            await asyncio.sleep(0.01)
        assert time.monotonic() - start >= lease
        assert h.receiver.quiesced(dest.transfer_id).done()  # nothing writes its blocks
        with pytest.raises(TransferTimeout):
            await h.receiver.wait(dest.transfer_id, 20)

    h.run(main())
