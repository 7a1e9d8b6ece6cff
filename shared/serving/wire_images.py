"""Prompt images on the node-to-node wire (prefill.proto's `PromptImage`): the resized RGB
bytes the decode node made of a client's image, checked again by the prefill node before its
engine sees them. Its content key is recomputed here, not trusted from the wire: it keys the
prefill node's prefix cache, which other requests read."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from proto.pdserve.v1 import prefill_pb2
from shared.engine.requests.multimodal import PromptImage
from shared.model.vision.image_processor import ImageProcessorConfig, grid_of
from shared.serving.images.image_hash import image_digest
from shared.serving.wire import WireError


def images_to_proto(images: Sequence[PromptImage]) -> list[prefill_pb2.PromptImage]:
    return [
        prefill_pb2.PromptImage(
            rgb=image.rgb.tobytes(), height=image.rgb.shape[0], width=image.rgb.shape[1]
        )
        for image in images
    ]


def images_from_proto(
    messages: Sequence[prefill_pb2.PromptImage], processor: ImageProcessorConfig | None
) -> list[PromptImage]:
    """The engine's images; WireError (INVALID_ARGUMENT) naming the image that is malformed,
    larger than the model's preprocessor allows, or sent to a text model."""
    if not messages:
        return []
    if processor is None:
        raise WireError("images", "images: this node's model takes text only")
    return [_image(i, m, processor) for i, m in enumerate(messages)]


def _image(
    index: int, msg: prefill_pb2.PromptImage, processor: ImageProcessorConfig
) -> PromptImage:
    height, width = msg.height, msg.width
    if height * width > processor.max_pixels:
        raise WireError(
            "images",
            f"image {index + 1}: {width}x{height} is over the model's {processor.max_pixels} "
            "pixels (the decode node resizes images to fit)",
        )
    if len(msg.rgb) != height * width * 3:
        raise WireError(
            "images",
            f"image {index + 1}: {len(msg.rgb)} bytes for {width}x{height} RGB "
            f"({height * width * 3} expected)",
        )
    rgb = np.frombuffer(msg.rgb, dtype=np.uint8).reshape(height, width, 3)
    try:
        grid = grid_of(rgb, processor)
    except ValueError as e:
        raise WireError("images", f"image {index + 1}: {e}") from None
    return PromptImage(rgb, grid, image_digest(rgb, grid))
