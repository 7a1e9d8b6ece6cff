"""A request's images made ready for the engine, for the HTTP and the gRPC API alike: each one
decoded and checked (shared/serving/images/image_decode.py), resized as the model's processor
settings say, and keyed by its content; and the prompt's one placeholder per image widened to the
tokens the image takes (as transformers' processor widens `<|image_pad|>`).

Every problem is the client's: an ImageError naming the image (or, for placeholders that do not
match the images, a ValueError), which each API turns into its own status.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.engine.requests.multimodal import PromptImage
from shared.model.config import ModelConfig
from shared.model.mrope import image_token_count
from shared.model.vision.image_processor import ImageProcessorConfig, grid_of, resized_rgb
from shared.serving.images.image_decode import decode_image_bytes, decode_image_url
from shared.serving.images.image_errors import ImageError
from shared.serving.images.image_hash import image_digest
from shared.serving.images.image_limits import ImageLimits

# an image as a client sends it: a data URL (HTTP, gRPC) or an encoded file's bytes (gRPC)
ImageSource = str | bytes


def prompt_images(
    sources: Sequence[ImageSource], processor: ImageProcessorConfig, limits: ImageLimits
) -> tuple[PromptImage, ...]:
    """The images in order, resized and keyed; ImageError naming the first bad one."""
    limits.check_count(len(sources))
    return tuple(_image(source, i, processor, limits) for i, source in enumerate(sources))


def _image(
    source: ImageSource, index: int, processor: ImageProcessorConfig, limits: ImageLimits
) -> PromptImage:
    if isinstance(source, bytes):
        picture = decode_image_bytes(source, limits, index)
    else:
        picture = decode_image_url(source, limits, index)
    try:
        rgb = resized_rgb(picture, processor)
        grid = grid_of(rgb, processor)
    except ValueError as e:  # an aspect ratio the model cannot take
        raise ImageError(index, str(e)) from None
    return PromptImage(rgb, grid, image_digest(rgb, grid))


def widen_placeholders(
    ids: list[int], images: Sequence[PromptImage], config: ModelConfig
) -> list[int]:
    """`ids` with the i-th image placeholder repeated as often as image i has tokens (as is,
    without images); ValueError when the prompt holds another number of placeholders than
    there are images."""
    image_token_id, vision = config.image_token_id, config.vision
    if not images or image_token_id is None or vision is None:
        return ids
    merge = vision.spatial_merge_size
    found = ids.count(image_token_id)
    if found != len(images):
        raise ValueError(f"the prompt holds {found} image placeholders for {len(images)} images")
    out: list[int] = []
    counts = iter(image_token_count(image.grid, merge) for image in images)
    for token in ids:
        out.extend([token] * next(counts) if token == image_token_id else [token])
    return out
