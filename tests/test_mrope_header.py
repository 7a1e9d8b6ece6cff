"""The request's mRoPE delta travels in the KV headers, under the transfer's token (over real
UCX: the receiver here, raw messages from a sender subprocess, as in tests/test_transfer.py):
what every message of a push carries is what the landing reports; a push whose messages
disagree fails; a forged header carrying a delta changes nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Iterator

import pytest
import torch

from tests.test_transfer import BLOCK_BYTES, LAYOUT, SENDER_BLOCKS, Harness, same, snapshot
from transfer import protocol
from transfer.errors import TransferError
from transfer.protocol import TransferDestination

FP = protocol.fingerprint_bytes(LAYOUT.fingerprint())


@pytest.fixture(scope="module")
def h() -> Iterator[Harness]:
    harness = Harness()
    setup = {"layout": dataclasses.asdict(LAYOUT), "num_blocks": SENDER_BLOCKS}
    harness.run(harness.sender.call(cmd="setup", fill="random", **setup))
    try:
        yield harness
    finally:
        harness.close()


def layer_message(
    dest: TransferDestination, layer: int, delta: int, token: bytes | None = None
) -> list[tuple[int, bytes]]:
    """Layer `layer` of every granted block as one message (seq = layer) carrying `delta`:
    header and payload, (tag, bytes) each."""
    token = dest.token if token is None else token
    header = protocol.encode_header(
        dest.transfer_id,
        token,
        FP,
        layer,
        dest.block_ids,
        BLOCK_BYTES * len(dest.block_ids),
        last=layer == LAYOUT.num_layers - 1,
        seq=layer,
        mrope_delta=delta,
    )
    body = os.urandom(BLOCK_BYTES * len(dest.block_ids))
    return [
        (dest.transfer_id, header),
        (protocol.payload_tag(token, dest.transfer_id, layer), body),
    ]


def test_a_header_round_trips_the_delta_beside_the_instance_stamp() -> None:
    token = os.urandom(16)
    for instance, delta in [(0, -7), (0x1234, -7), (0x1234, 1 << 40), (0, 0)]:
        raw = protocol.encode_header(
            9, token, FP, 0, (3, 4), 2 * BLOCK_BYTES, instance_id=instance, mrope_delta=delta
        )
        prefix = protocol.decode_prefix(raw)
        assert len(raw) == protocol.header_size(2, instance != 0, delta != 0)
        assert prefix.has_mrope == (delta != 0) and prefix.stamped == (instance != 0)
        assert protocol.decode_instance(raw, prefix) == instance
        assert protocol.decode_mrope_delta(raw, prefix) == delta
    with pytest.raises(ValueError, match="64-bit signed"):
        protocol.encode_header(9, token, FP, 0, (3,), BLOCK_BYTES, mrope_delta=1 << 63)


@pytest.mark.parametrize("delta", [0, -5, 12])
def test_the_landing_reports_the_delta_its_headers_carried(h: Harness, delta: int) -> None:
    async def main() -> None:
        dest = h.receiver.expect(f"req-delta{delta}", [3, 5])
        landed = asyncio.ensure_future(h.receiver.wait(dest.transfer_id, 20))
        for layer in range(LAYOUT.num_layers):
            await h.raw(*layer_message(dest, layer, delta))
        stats = await landed
        assert stats.mrope_delta == delta and stats.messages == LAYOUT.num_layers

    h.run(main())


def test_a_push_whose_messages_disagree_on_the_delta_fails(h: Harness) -> None:
    async def main() -> None:
        dest = h.receiver.expect("req-disagree", [6])
        landed = asyncio.ensure_future(h.receiver.wait(dest.transfer_id, 20))
        before = h.receiver.rejected_by_reason.get(protocol.REJECT_BAD_DELTA, 0)
        await h.raw(*layer_message(dest, 0, -5))
        await h.raw(*layer_message(dest, 1, -4))
        with pytest.raises(TransferError, match="mRoPE delta -4"):
            await landed
        assert h.receiver.rejected_by_reason[protocol.REJECT_BAD_DELTA] == before + 1
        await h.receiver.release(dest.transfer_id, 5)

    h.run(main())


def test_a_forged_header_carrying_a_delta_changes_nothing(h: Harness) -> None:
    """Without the token a header is noise: its delta is not the transfer's, and the real
    sender's messages land with theirs."""

    async def main() -> None:
        dest = h.receiver.expect("req-forged", [7])
        landed = asyncio.ensure_future(h.receiver.wait(dest.transfer_id, 20))
        before = snapshot(h.pool)
        await h.raw(*layer_message(dest, 0, 99, token=os.urandom(16)))
        assert same(h.pool, before) and not landed.done()
        for layer in range(LAYOUT.num_layers):
            await h.raw(*layer_message(dest, layer, -2))
        assert (await landed).mrope_delta == -2
        assert not torch.equal(h.pool[:, :, 7], before[:, :, 7])

    h.run(main())
