"""The Encoder servicer: a prompt's images in, their embeddings out (proto/pdserve/v1/
encoder.proto), from a vision tower loaded alone (no text model, no KV pool).

The tower runs on one worker thread, one call at a time (a CPU runs one tower's GEMMs well; two
would share its cores), so the event loop keeps answering health checks and refusing excess
calls (RESOURCE_EXHAUSTED past max_pending) while it computes. Recent images' embeddings are kept
by content, bounded in bytes: a repeated image costs a lookup.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from encode_node.config import EncodeNodeConfig
from proto.pdserve.v1 import encoder_pb2
from shared.engine.requests.multimodal import PromptImage
from shared.model.device import resolve_dtype
from shared.model.vision.embedding_cache import EmbeddingCache
from shared.model.vision.image_encoder import ImageEncoder
from shared.serving.grpc_server import NodeServing
from shared.serving.wire import WireError
from shared.serving.wire_images import images_from_proto

log = logging.getLogger(__name__)
SERVICE_DESCRIPTOR = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"]


class EncodeNode:
    def __init__(self, config: EncodeNodeConfig, encoder: ImageEncoder | None = None) -> None:
        config.validate()
        self.config = config
        self.encoder = encoder or ImageEncoder.load(
            Path(config.model), resolve_dtype(config.dtype, torch.device("cpu"))
        )
        self.cache: EmbeddingCache[PromptImage, np.ndarray] = EmbeddingCache(
            self._encode_now, config.cache_bytes
        )
        # one worker: the tower runs one call at a time, and the cache is read and filled there
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="encode")
        self._pending = 0
        self.registry = CollectorRegistry()
        self.images = Counter(
            "pdserve_encoder_images",
            "Images asked for, by where their embeddings came from",
            ["source"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "pdserve_encoder_call_seconds", "Encode calls, queue included", registry=self.registry
        )
        self.serving: NodeServing | None = None
        self.port = config.port

    async def start(self) -> None:
        self.serving = await NodeServing.serve(self, SERVICE_DESCRIPTOR, self.config, self.registry)
        self.port = self.serving.port
        log.info("encoder node serving on %s:%d", self.config.host, self.port)

    async def stop(self, grace: float = 5.0) -> bool:
        if self.serving is not None:
            await self.serving.stop_admitting(grace)
            await self.serving.close_metrics()
        # the encode in flight (if any) finishes on the worker; the loop keeps running meanwhile
        await asyncio.to_thread(self._worker.shutdown, True)
        return True

    async def Encode(
        self, request: encoder_pb2.EncodeRequest, context
    ) -> encoder_pb2.EncodeResponse:
        if len(request.images) > self.config.max_images:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.images)} images in one call; at most {self.config.max_images}",
            )
        try:
            images = images_from_proto(request.images, self.encoder.processor)
        except WireError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self._pending >= self.config.max_pending:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"encoder has {self._pending} calls pending (max_pending); encode locally",
            )
        self._pending += 1
        try:
            with self.seconds.time():
                loop = asyncio.get_running_loop()
                arrays, fresh = await loop.run_in_executor(self._worker, self._embeddings, images)
        finally:
            self._pending -= 1
        self.images.labels(source="encoded").inc(fresh)
        self.images.labels(source="cached").inc(len(images) - fresh)
        return encoder_pb2.EncodeResponse(
            embeddings=[
                encoder_pb2.Embeddings(
                    data=a.astype("<f4", copy=False).tobytes(),
                    tokens=a.shape[0],
                    hidden_size=a.shape[1],
                )
                for a in arrays
            ],
            cached=len(images) - fresh,
        )

    def _embeddings(self, images: list[PromptImage]) -> tuple[list[np.ndarray], int]:
        """On the worker: the images' embeddings, and how many of them the tower computed."""
        before = self.cache.encoded_images
        arrays = self.cache.embeddings(images)
        return arrays, self.cache.encoded_images - before

    def _encode_now(self, images: list[PromptImage]) -> list[np.ndarray]:
        return self.encoder.encode([(image.rgb, image.grid) for image in images])
