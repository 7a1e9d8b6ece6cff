"""A prefill node's encoder nodes (E/P/D, `--encoder`): the images of a prompt go to one of them
(round robin) and come back as embeddings the engine takes instead of running its own tower.

An encoder that fails (down, busy, too slow, a malformed answer) costs nothing but time: the
prompt's images are then encoded here, as on a prefill node without encoders, and the next
prompt tries the next encoder. Every call has a deadline: the prefill's own, at most
`ENCODE_TIMEOUT_S`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import numpy as np
from grpc import aio

from proto.pdserve.v1 import encoder_pb2, encoder_pb2_grpc
from shared.engine.requests.multimodal import PromptImage
from shared.model.mrope import image_token_count
from shared.serving.grpc_server import GRPC_SERVER_OPTIONS
from shared.serving.wire_images import images_to_proto

log = logging.getLogger(__name__)

ENCODE_TIMEOUT_S = 30.0


class EncoderClients:
    def __init__(self, targets: Sequence[str], hidden_size: int, merge: int) -> None:
        self.targets = tuple(targets)
        self.hidden_size, self.merge = hidden_size, merge
        self._channels = [aio.insecure_channel(t, options=GRPC_SERVER_OPTIONS) for t in targets]
        self._stubs = [encoder_pb2_grpc.EncoderStub(c) for c in self._channels]
        self._next = itertools.cycle(range(len(targets)))
        self.remote_images = 0  # encoded by an encoder node
        self.local_images = 0  # encoded here after an encoder failed

    async def encode(self, request_id: str, images: Sequence[PromptImage]) -> list[PromptImage]:
        """`images` with an encoder's embeddings; unchanged (the engine encodes them) when
        there is no encoder or the one asked failed."""
        if not images or not self._stubs:
            return list(images)
        i = next(self._next)
        request = encoder_pb2.EncodeRequest(request_id=request_id, images=images_to_proto(images))
        try:
            answer = await self._stubs[i].Encode(request, timeout=ENCODE_TIMEOUT_S)
            arrays = self._arrays(answer, images)
        except (aio.AioRpcError, ValueError) as e:
            log.warning("%s: encoder %s failed (%s); encoding here", request_id, self.targets[i], e)
            self.local_images += len(images)
            return list(images)
        self.remote_images += len(images)
        return [image.encoded(a) for image, a in zip(images, arrays, strict=True)]

    def _arrays(
        self, answer: encoder_pb2.EncodeResponse, images: Sequence[PromptImage]
    ) -> list[np.ndarray]:
        """The answer's embeddings, checked against what the images need (ValueError)."""
        if len(answer.embeddings) != len(images):
            raise ValueError(f"{len(answer.embeddings)} embeddings for {len(images)} images")
        arrays = []
        for e, image in zip(answer.embeddings, images, strict=True):
            tokens = image_token_count(image.grid, self.merge)
            shape = (e.tokens, e.hidden_size)
            if shape != (tokens, self.hidden_size) or len(e.data) != tokens * e.hidden_size * 4:
                raise ValueError(f"embeddings of {shape} for an image of {tokens} tokens")
            # a copy: the engine's own, writable, not a view of the message's bytes
            arrays.append(np.frombuffer(e.data, dtype="<f4").reshape(shape).copy())
        return arrays

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
