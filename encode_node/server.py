"""The Encoder servicer: a prompt's images in, their embeddings out (proto/pdserve/v1/
encoder.proto), from a vision tower loaded alone (no text model, no KV pool).

The tower runs on one worker thread, one call at a time (a CPU runs one tower's GEMMs well; two
would share its cores), so the event loop keeps answering health checks and refusing excess
calls (RESOURCE_EXHAUSTED past max_pending) while it computes. Recent images' embeddings are kept
by content, bounded in bytes: a repeated image costs a lookup.

A call that names a destination gets its embeddings pushed over UCX into the caller's landing
area (one KV message under the call's token: transfer/embedding_rows.py) and an answer that
carries their shapes only; one that names none, or whose push fails, gets them as bytes.
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
from shared.model.mrope import image_token_count
from shared.model.vision.embedding_cache import EmbeddingCache
from shared.model.vision.image_encoder import ImageEncoder
from shared.serving.grpc_server import NodeServing
from shared.serving.wire import WireError
from shared.serving.wire_destination import destination_from_proto
from shared.serving.wire_images import images_from_proto
from transfer.embedding_rows import blocks_for, embedding_layout, pack_rows
from transfer.errors import TransferError
from transfer.protocol import TransferDestination
from transfer.ucx import KvMessage, KvSender

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
        self._senders: dict[int, KvSender] = {}  # by the landing areas' rows per block
        self.pushed = 0  # calls answered by a push

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
        for sender in self._senders.values():
            await sender.close()
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
        dest = None
        if request.HasField("destination"):
            try:
                dest = self._destination(request, images)
            except ValueError as e:
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
        cached = len(images) - fresh
        if dest is not None and await self._push(request, dest, arrays):
            shapes = [
                encoder_pb2.Embeddings(tokens=a.shape[0], hidden_size=a.shape[1]) for a in arrays
            ]
            return encoder_pb2.EncodeResponse(embeddings=shapes, cached=cached, pushed=True)
        return encoder_pb2.EncodeResponse(
            embeddings=[
                encoder_pb2.Embeddings(
                    data=a.astype("<f4", copy=False).tobytes(),
                    tokens=a.shape[0],
                    hidden_size=a.shape[1],
                )
                for a in arrays
            ],
            cached=cached,
        )

    def _destination(
        self, request: encoder_pb2.EncodeRequest, images: list[PromptImage]
    ) -> TransferDestination:
        """The call's landing grant, checked against its images' rows (ValueError)."""
        dest = destination_from_proto(request.destination)
        merge = self.encoder.processor.merge_size
        rows = sum(image_token_count(image.grid, merge) for image in images)
        block_rows = request.landing_block_rows
        if block_rows < 1 or len(dest.block_ids) != blocks_for(rows, block_rows):
            raise ValueError(
                f"a landing grant of {len(dest.block_ids)} blocks of "
                f"{request.landing_block_rows} rows for {rows} rows of embeddings"
            )
        return dest

    async def _push(
        self,
        request: encoder_pb2.EncodeRequest,
        dest: TransferDestination,
        arrays: list[np.ndarray],
    ) -> bool:
        """Push `arrays` into `dest`; False (the caller answers bytes) when that failed."""
        rows = request.landing_block_rows
        sender = self._senders.get(rows)
        if sender is None:
            layout = embedding_layout(self.encoder.vision.out_hidden_size, rows)
            sender = self._senders[rows] = KvSender(layout)
        try:
            push = sender.open(dest)
            payload = pack_rows(arrays, sender.layout)
            await push.send(KvMessage(layer=0, blocks=dest.block_ids, payload=payload, last=True))
        except TransferError as e:
            log.warning("%s: pushing embeddings failed (%s); answering them", request.request_id, e)
            return False
        self.pushed += 1
        return True

    def _embeddings(self, images: list[PromptImage]) -> tuple[list[np.ndarray], int]:
        """On the worker: the images' embeddings, and how many of them the tower computed."""
        before = self.cache.encoded_images
        arrays = self.cache.embeddings(images)
        return arrays, self.cache.encoded_images - before

    def _encode_now(self, images: list[PromptImage]) -> list[np.ndarray]:
        return self.encoder.encode([(image.rgb, image.grid) for image in images])
