"""The transfer plane's pure parts, no UCX: the KV layout's byte spans, header validation, and a
transfer's landing bookkeeping (claims, seq window, accounting, fence)."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.kv.layout import KvLayout
from shared.kv.pool import allocate_kv_pool
from transfer import protocol
from transfer.errors import ProtocolError
from transfer.landing import SEQ_WINDOW, Landing, LandingState, Progress
from transfer.landings import Landings

LAYOUT = KvLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2, dtype="bfloat16")
FP = protocol.fingerprint_bytes(LAYOUT.fingerprint())


# ---- byte spans ---------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(1, 12),
    data=st.data(),
    merge=st.booleans(),
)
def test_block_spans_cover_exactly_the_payload(num_blocks: int, data, merge: bool) -> None:
    """Reading the spans out of a pool gives the bytes of kv_pool[layers][:, :, ids], in order."""
    layer = data.draw(st.integers(0, LAYOUT.num_layers - 1))
    n_layers = data.draw(st.integers(1, LAYOUT.num_layers - layer))
    ids = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, unique=True))
    pool = allocate_kv_pool(LAYOUT, num_blocks, "cpu")
    pool.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, pool.shape, dtype=torch.int16))
    flat = pool.view(torch.uint8).reshape(-1)
    offsets, lengths = LAYOUT.block_spans(num_blocks, layer, n_layers, ids, merge=merge)
    got = torch.cat(
        [flat[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)]
    )
    want = pool[layer : layer + n_layers][:, :, ids].contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(got, want)
    assert int(lengths.sum()) == LAYOUT.payload_bytes(n_layers, len(ids))
    if not merge:
        assert len(offsets) == 2 * n_layers * len(ids)


def test_block_spans_merge_adjacent_blocks_and_refuse_bad_input() -> None:
    offsets, lengths = LAYOUT.block_spans(8, 0, 1, [2, 3, 4, 7])
    b = LAYOUT.plane_block_bytes
    assert lengths.tolist() == [3 * b, b] * 2
    assert offsets.tolist() == [2 * b, 7 * b, 8 * b + 2 * b, 8 * b + 7 * b]  # K runs, V runs
    for bad in ([], [8], [-1]):
        with pytest.raises(ValueError):
            LAYOUT.block_spans(8, 0, 1, bad)
    with pytest.raises(ValueError):
        LAYOUT.block_spans(8, 2, 2, [0])


# ---- header validation --------------------------------------------------------------------------
def _header(token: bytes, **kw) -> bytes:
    fields = {"layer": 0, "block_ids": (5, 6), "seq": 0, "n_layers": 1}
    fields.update(kw)
    nbytes = fields.pop("payload_bytes", None)
    if nbytes is None:
        nbytes = LAYOUT.payload_bytes(fields["n_layers"], len(fields["block_ids"]))
    fp = fields.pop("fingerprint", FP)
    tid = fields.pop("transfer_id", 9)
    return protocol.encode_header(
        tid,
        token,
        fp,
        fields["layer"],
        fields["block_ids"],
        nbytes,
        seq=fields["seq"],
        n_layers=fields["n_layers"],
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"transfer_id": 10}, protocol.REJECT_UNKNOWN_TRANSFER),
        ({"token": b"x" * 16}, protocol.REJECT_BAD_TOKEN),
        ({"fingerprint": b"y" * 8}, protocol.REJECT_LAYOUT),
        ({"layer": 2, "n_layers": 2}, protocol.REJECT_BAD_LAYER),
        ({"block_ids": (1, 2, 3)}, protocol.REJECT_BAD_BLOCK),
        ({"payload_bytes": 7}, protocol.REJECT_BAD_LENGTH),
    ],
)
def test_validate_header_names_what_is_wrong(change: dict, reason: str) -> None:
    token = secrets.token_bytes(16)
    head = _header(change.pop("token", token), **change)
    with pytest.raises(ProtocolError) as e:
        protocol.validate_header(
            head, transfer_id=9, token=token, layout=LAYOUT, fingerprint=FP, max_blocks=2
        )
    assert e.value.reason == reason
    assert (reason in protocol.NOISE_REASONS) == (reason in {"unknown_transfer", "bad_token"})


def test_validate_header_accepts_a_good_one_and_checks_its_length() -> None:
    token = secrets.token_bytes(16)
    head = _header(token, layer=1, n_layers=2)
    prefix, ids = protocol.validate_header(
        head, transfer_id=9, token=token, layout=LAYOUT, fingerprint=FP, max_blocks=2
    )
    assert ids == (5, 6) and (prefix.layer, prefix.n_layers) == (1, 2)
    with pytest.raises(ProtocolError) as e:
        protocol.validate_header(
            head + bytes(64),
            transfer_id=9,
            token=token,
            layout=LAYOUT,
            fingerprint=FP,
            max_blocks=2,
        )
    assert e.value.reason == protocol.REJECT_BAD_LENGTH


# ---- landing bookkeeping ------------------------------------------------------------------------
def _landing(loop: asyncio.AbstractEventLoop, blocks: tuple[int, ...], seen: list[int]) -> Landing:
    return Landing(
        7,
        "r",
        b"t" * 16,
        blocks,
        LAYOUT.num_layers,
        0.0,
        seen.append,
        done=loop.create_future(),
        quiesced=loop.create_future(),
    )


def _prefix(layer: int, n_layers: int, ids: tuple[int, ...], seq: int, last: bool = False):
    head = protocol.encode_header(
        7, b"t" * 16, FP, layer, ids, LAYOUT.payload_bytes(n_layers, len(ids)), last, seq, n_layers
    )
    return protocol.decode_prefix(head)


def test_landing_claims_accounts_and_calls_back_in_layer_order() -> None:
    loop = asyncio.new_event_loop()
    try:
        seen: list[int] = []
        t = _landing(loop, (4, 9), seen)
        table = Landings()
        table.add(t)
        assert t.window_end == SEQ_WINDOW and table.payload_owner(next(iter(t.tags))) is t
        a = t.check_claims(_prefix(1, 2, (9, 4), 0), (9, 4))  # layers 1-2 first
        t.claim(0, a)
        for bad, reason in (
            ((_prefix(2, 1, (4,), 1), (4,)), protocol.REJECT_DUPLICATE),  # claimed already
            ((_prefix(0, 1, (5,), 1), (5,)), protocol.REJECT_BAD_BLOCK),  # not reserved
            ((_prefix(0, 1, (4, 4), 1), (4, 4)), protocol.REJECT_DUPLICATE),  # listed twice
            ((_prefix(0, 1, (4,), 0), (4,)), protocol.REJECT_BAD_SEQ),  # seq used
            ((_prefix(0, 1, (4,), SEQ_WINDOW), (4,)), protocol.REJECT_BAD_SEQ),  # too far ahead
        ):
            with pytest.raises(ProtocolError) as e:
                t.check_claims(*bad)
            assert e.value.reason == reason
        assert t.take_announced(0) is a and t.take_announced(0) is None
        assert t.account(a, 1.0) is Progress.MORE
        t.fire_layer_callbacks()
        assert seen == []  # layer 0 is still missing: callbacks go in layer order
        b = t.check_claims(_prefix(0, 1, (4, 9), 1, last=True), (4, 9))
        t.claim(1, b)
        assert t.account(t.take_announced(1), 2.0) is Progress.COMPLETE
        t.fire_layer_callbacks()
        assert seen == [0, 1, 2] and t.stats.messages == 2 and t.missing == 0
        assert t.stats.bytes == LAYOUT.payload_bytes(LAYOUT.num_layers, 2)
        t.finish(LandingState.COMPLETE)
        table.retire(t, 3.0)
        assert t.quiesced.done() and not table.live and table.is_dead(7)
        assert table.find(7) is t
        table.collect(7)
        assert table.find(7) is None
    finally:
        loop.close()


def test_a_failed_landing_stays_fenced_while_it_writes() -> None:
    loop = asyncio.new_event_loop()
    try:
        t = _landing(loop, (1,), [])
        table = Landings()
        table.add(t)
        t.claim(0, t.check_claims(_prefix(0, 1, (1,), 0, last=True), (1,)))
        t.writing = 1
        t.finish(LandingState.FAILED)
        table.retire(t, 0.0)
        assert table.fenced == {7: t} and not t.quiesced.done()
        t.writing = 0
        table.unfence(t)
        assert not table.fenced and t.quiesced.done()
        with pytest.raises(ProtocolError):  # every pair of layer 0 is claimed already
            t.check_claims(_prefix(0, 1, (1,), 1), (1,))
    finally:
        loop.close()


def test_a_last_message_with_pairs_missing_is_short() -> None:
    loop = asyncio.new_event_loop()
    try:
        t = _landing(loop, (1, 2), [])
        t.extend_window(SEQ_WINDOW)
        a = t.check_claims(_prefix(0, 3, (1,), 0, last=True), (1,))
        t.claim(0, a)
        assert t.account(a, 0.0) is Progress.SHORT and t.missing == 3
        assert "pairs missing" in t.short_message()
    finally:
        loop.close()
