"""A prefill node's encoder nodes (E/P/D, `--encoder`): the images of a prompt go to one of them
(round robin) and come back as embeddings the engine takes instead of running its own tower.

The embeddings come over UCX, pushed by the encoder into this node's landing area
(prefill_node/embedding_landing.py), when the area has room for them; else, or from an encoder
that predates the push, as bytes in the answer. An encoder that fails (down, busy, too slow, a
malformed answer or push) costs nothing but time: the prompt's images are then encoded here, as
on a prefill node without encoders, and the next prompt tries the next encoder. Every call has
a deadline: `ENCODE_TIMEOUT_S`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

import grpc
import numpy as np
from grpc import aio
from prometheus_client import CollectorRegistry, Counter, Gauge

from prefill_node.embedding_landing import BLOCK_ROWS, EmbeddingLanding
from proto.pdserve.v1 import encoder_pb2, encoder_pb2_grpc
from shared.engine.requests.multimodal import PromptImage
from shared.model.mrope import image_token_count
from shared.serving.grpc_server import GRPC_SERVER_OPTIONS
from shared.serving.wire_destination import destination_to_proto
from shared.serving.wire_images import images_to_proto
from transfer.errors import TransferError
from transfer.protocol import TransferDestination

log = logging.getLogger(__name__)

ENCODE_TIMEOUT_S = 30.0


class EncoderClients:
    def __init__(
        self,
        targets: Sequence[str],
        hidden_size: int,
        merge: int,
        landing: EmbeddingLanding | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """`credentials`: TLS to the encoders (None: plaintext); `registry`: where the image
        counts and the landing area's free blocks are exported."""
        self.targets = tuple(targets)
        self.hidden_size, self.merge = hidden_size, merge
        self.landing = landing
        self._channels = [
            aio.insecure_channel(t, options=GRPC_SERVER_OPTIONS)
            if credentials is None
            else aio.secure_channel(t, credentials, options=GRPC_SERVER_OPTIONS)
            for t in targets
        ]
        self._stubs = [encoder_pb2_grpc.EncoderStub(c) for c in self._channels]
        self._next = itertools.cycle(range(len(targets)))
        self.remote_images = 0  # encoded by an encoder node
        self.pushed_images = 0  # of those, pushed into the landing area
        self.local_images = 0  # encoded here after an encoder failed
        self._images = Counter(
            "pdserve_prompt_images",
            "A prompt's images by where their embeddings came from: an encoder's push, an "
            "encoder's answer, or encoded here after an encoder failed",
            ["source"],
            registry=registry,
        )
        if landing is not None and registry is not None:
            free = Gauge(
                "pdserve_embedding_landing_free_blocks",
                f"Free blocks ({BLOCK_ROWS} rows each) of the area encoders push embeddings into",
                registry=registry,
            )
            free.set_function(lambda: landing.blocks.free)

    async def encode(self, request_id: str, images: Sequence[PromptImage]) -> list[PromptImage]:
        """`images` with an encoder's embeddings; unchanged (the engine encodes them) when
        there is no encoder or the one asked failed."""
        if not images or not self._stubs:
            return list(images)
        i = next(self._next)
        counts = [image_token_count(image.grid, self.merge) for image in images]
        dest = None
        if self.landing is not None:
            dest = self.landing.grant(request_id, sum(counts), ENCODE_TIMEOUT_S)
        try:
            arrays = await self._ask(i, request_id, images, counts, dest)
        except (aio.AioRpcError, ValueError, TransferError) as e:
            log.warning("%s: encoder %s failed (%s); encoding here", request_id, self.targets[i], e)
            self.local_images += len(images)
            self._images.labels(source="local").inc(len(images))
            return list(images)
        finally:
            if dest is not None:
                assert self.landing is not None
                await self.landing.release(dest)
        self.remote_images += len(images)
        return [image.encoded(a) for image, a in zip(images, arrays, strict=True)]

    async def _ask(
        self,
        i: int,
        request_id: str,
        images: Sequence[PromptImage],
        counts: list[int],
        dest: TransferDestination | None,
    ) -> list[np.ndarray]:
        """Encoder `i`'s embeddings of `images`: pushed into `dest` or answered as bytes."""
        request = encoder_pb2.EncodeRequest(request_id=request_id, images=images_to_proto(images))
        if dest is not None:
            request.destination.CopyFrom(destination_to_proto(dest))
            request.landing_block_rows = BLOCK_ROWS
        deadline = time.monotonic() + ENCODE_TIMEOUT_S
        answer = await self._stubs[i].Encode(request, timeout=ENCODE_TIMEOUT_S)
        shapes = [(e.tokens, e.hidden_size) for e in answer.embeddings]
        if shapes != [(n, self.hidden_size) for n in counts]:
            raise ValueError(f"embeddings of {shapes} for images of {counts} tokens")
        if not answer.pushed:
            arrays = self._arrays(answer)
            self._images.labels(source="answered").inc(len(images))
            return arrays
        if dest is None or self.landing is None:
            raise ValueError("the encoder says it pushed embeddings nobody asked it to push")
        arrays = await self.landing.collect(dest, counts, max(0.001, deadline - time.monotonic()))
        self.pushed_images += len(images)
        self._images.labels(source="pushed").inc(len(images))
        return arrays

    def _arrays(self, answer: encoder_pb2.EncodeResponse) -> list[np.ndarray]:
        """The answer's embeddings as bytes, checked for length (ValueError)."""
        arrays = []
        for e in answer.embeddings:
            if len(e.data) != e.tokens * e.hidden_size * 4:
                raise ValueError(f"{len(e.data)} bytes for {e.tokens} x {e.hidden_size} floats")
            # a copy: the engine's own, writable, not a view of the message's bytes
            arrays.append(np.frombuffer(e.data, dtype="<f4").reshape(e.tokens, -1).copy())
        return arrays

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        if self.landing is not None:
            await self.landing.close()
