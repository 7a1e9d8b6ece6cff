"""E/P/D over UCX: an encoder node pushes a prompt's embeddings into the prefill node's landing
area (real encoder node, real gRPC, real UCX, a tiny Qwen2-VL tower): the rows that land are
the ones the bytes answer carries, every landing block is back after each call, an area too
small sends the call the bytes way, and a grant that does not fit the images is refused."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from encode_node.config import EncodeNodeConfig
from encode_node.server import EncodeNode
from pdserve.bench.support.vl_checkpoints import MERGE, TINY
from pdserve.client import create_channel
from prefill_node.embedding_landing import BLOCK_ROWS, EmbeddingLanding
from prefill_node.encoders import EncoderClients
from proto.pdserve.v1 import encoder_pb2, encoder_pb2_grpc
from shared.serving.tls import ClientTls, ServerTls
from shared.serving.wire_destination import destination_to_proto
from shared.serving.wire_images import images_to_proto
from tests.support.vision_checkpoints import QWEN2_VL, build_vl_checkpoint, random_image
from tests.test_tls import make_pki

HIDDEN = TINY.hidden
# two images of 36 rows each: 72 rows, two landing blocks of 64
IMAGES = [random_image((1, 12, 12), seed=1), random_image((1, 12, 12), seed=2)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vl_checkpoint(tmp_path_factory.mktemp("vl-push"), QWEN2_VL)


def _run(
    checkpoint: Path,
    body: Callable[[EncodeNode, str], Awaitable[None]],
    tls: ServerTls | None = None,
) -> None:
    async def main() -> None:
        config = EncodeNodeConfig(model=str(checkpoint), dtype="float32", port=0, tls=tls)
        encoder = EncodeNode(config)
        await encoder.start()
        try:
            await body(encoder, f"127.0.0.1:{encoder.port}")
        finally:
            await encoder.stop(grace=1.0)

    asyncio.run(main())


def _conserved(landing: EmbeddingLanding) -> None:
    landing.blocks.check_conservation()
    assert landing.blocks.free == landing.blocks.num_blocks and not landing.blocks.quarantined
    assert landing.receiver.live_transfers == 0


def test_pushed_embeddings_are_the_answered_ones(checkpoint: Path) -> None:
    async def body(encoder: EncodeNode, target: str) -> None:
        landing = EmbeddingLanding(HIDDEN, 1 << 20, "127.0.0.1")
        await landing.start()
        pushed = EncoderClients([target], HIDDEN, MERGE, landing)
        answered = EncoderClients([target], HIDDEN, MERGE)
        try:
            for _ in range(2):  # the second from the encoder's cache, pushed again
                got = await pushed.encode("pushed", IMAGES)
                _conserved(landing)
            want = await answered.encode("answered", IMAGES)
        finally:
            await pushed.close()
            await answered.close()
        assert (pushed.pushed_images, pushed.remote_images, pushed.local_images) == (4, 4, 0)
        assert (answered.pushed_images, answered.remote_images) == (0, 2)
        assert encoder.pushed == 2
        for a, b in zip(got, want, strict=True):
            assert a.embeddings is not None and b.embeddings is not None
            assert a.embeddings.shape == (36, HIDDEN)
            assert np.array_equal(a.embeddings, b.embeddings)
        assert landing.receiver.completed_total == 2

    _run(checkpoint, body)


def test_a_landing_area_too_small_gets_the_bytes(checkpoint: Path) -> None:
    async def body(encoder: EncodeNode, target: str) -> None:
        one_block = BLOCK_ROWS * HIDDEN * 4
        landing = EmbeddingLanding(HIDDEN, one_block, "127.0.0.1")
        await landing.start()
        clients = EncoderClients([target], HIDDEN, MERGE, landing)
        try:
            got = await clients.encode("big", IMAGES)  # 72 rows: two blocks
            small = await clients.encode("small", IMAGES[:1])  # 36 rows: one
        finally:
            await clients.close()
        assert landing.blocks.num_blocks == 1
        assert (clients.remote_images, clients.pushed_images) == (3, 1)
        assert all(image.embeddings is not None for image in [*got, *small])
        assert np.array_equal(got[0].embeddings, small[0].embeddings)
        _conserved(landing)

    _run(checkpoint, body)


def test_a_grant_that_does_not_fit_the_images_is_refused(checkpoint: Path) -> None:
    async def body(encoder: EncodeNode, target: str) -> None:
        landing = EmbeddingLanding(HIDDEN, 1 << 20, "127.0.0.1")
        await landing.start()
        dest = landing.grant("short", rows=10, lease=10)  # one block for 72 rows
        assert dest is not None
        request = encoder_pb2.EncodeRequest(
            request_id="short",
            images=images_to_proto(IMAGES),
            destination=destination_to_proto(dest),
            landing_block_rows=BLOCK_ROWS,
        )
        try:
            async with create_channel(target) as channel:
                stub = encoder_pb2_grpc.EncoderStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Encode(request, timeout=10)
        finally:
            await landing.release(dest)
            await landing.close()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "1 blocks of 64 rows for 72 rows" in (refused.value.details() or "")
        assert encoder.pushed == 0
        _conserved(landing)

    _run(checkpoint, body)


def test_a_push_that_fails_is_answered_as_bytes(checkpoint: Path) -> None:
    """Nothing listens at the destination's address: the encoder's push fails, and the call is
    answered with the embeddings as bytes instead (the caller takes those)."""

    async def body(encoder: EncodeNode, target: str) -> None:
        landing = EmbeddingLanding(HIDDEN, 1 << 20, "127.0.0.1")
        await landing.start()
        dest = landing.grant("nowhere", rows=72, lease=10)
        assert dest is not None
        request = encoder_pb2.EncodeRequest(
            request_id="nowhere",
            images=images_to_proto(IMAGES),
            destination=destination_to_proto(dataclasses.replace(dest, address="127.0.0.1:1")),
            landing_block_rows=BLOCK_ROWS,
        )
        try:
            async with create_channel(target) as channel:
                stub = encoder_pb2_grpc.EncoderStub(channel)
                answer = await stub.Encode(request, timeout=30)
        finally:
            await landing.release(dest)
            await landing.close()
        assert not answer.pushed and encoder.pushed == 0
        assert [len(e.data) for e in answer.embeddings] == [36 * HIDDEN * 4] * 2
        _conserved(landing)

    _run(checkpoint, body)


def test_encoders_over_mutual_tls(checkpoint: Path, tmp_path: Path) -> None:
    """An encoder node that requires client certificates: a prefill node with --encoder-tls-*
    gets the pushed embeddings; one without falls back to encoding locally."""
    pki = make_pki(tmp_path)
    server = ServerTls(pki["server.pem"], pki["server.key"], pki["ca.pem"])
    client = ClientTls(pki["ca.pem"], pki["client.pem"], pki["client.key"])

    async def body(encoder: EncodeNode, target: str) -> None:
        landing = EmbeddingLanding(HIDDEN, 1 << 20, "127.0.0.1")
        await landing.start()
        secure = EncoderClients([target], HIDDEN, MERGE, landing, client.credentials())
        plain = EncoderClients([target], HIDDEN, MERGE)
        try:
            got = await secure.encode("tls", IMAGES)
            local = await plain.encode("plain", IMAGES)
        finally:
            await secure.close()
            await plain.close()
        assert (secure.pushed_images, secure.local_images) == (2, 0)
        assert all(image.embeddings is not None for image in got)
        assert plain.local_images == 2 and all(image.embeddings is None for image in local)
        _conserved(landing)

    _run(checkpoint, body, server)
