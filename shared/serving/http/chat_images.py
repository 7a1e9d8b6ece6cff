"""A chat request's images: its `image_url` content parts decoded, checked and preprocessed as
the model's processor settings say, and the chat template's one placeholder per image widened to
the tokens the image takes (as transformers' processor widens `<|image_pad|>`).

Every problem is the client's and answered 400 (413 for an image over the byte limit) naming the
image; a text-only model refuses images rather than dropping them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from shared.engine.requests.multimodal import PromptImage
from shared.model.mrope import image_token_count
from shared.model.vision.image_processor import ImageProcessorConfig, grid_of, resized_rgb
from shared.serving.http.errors import ApiError
from shared.serving.http.schemas import ChatMessage
from shared.serving.images.image_decode import decode_image_url
from shared.serving.images.image_errors import ImageError
from shared.serving.images.image_hash import image_digest
from shared.serving.images.image_limits import ImageLimits


class Prompt(NamedTuple):
    """One prompt of a request: its ids, its text (what echo prepends), its images."""

    ids: list[int]
    text: str
    images: tuple[PromptImage, ...] = ()


def request_images(
    messages: Sequence[ChatMessage],
    processor: ImageProcessorConfig | None,
    limits: ImageLimits,
    model_name: str,
) -> tuple[PromptImage, ...]:
    """The messages' images in order, ready for the engine."""
    urls = [part.image_url.url for m in messages for part in m.image_parts()]
    if not urls:
        return ()
    if processor is None:
        raise ApiError(
            400,
            f"model `{model_name}` takes text only: remove the image_url content parts",
            param="messages",
        )
    try:
        limits.check_count(len(urls))
        return tuple(_image(url, i, processor, limits) for i, url in enumerate(urls))
    except ImageError as e:
        raise ApiError(e.http_status, str(e), param="messages") from None


def _image(
    url: str, index: int, processor: ImageProcessorConfig, limits: ImageLimits
) -> PromptImage:
    picture = decode_image_url(url, limits, index)
    try:
        rgb = resized_rgb(picture, processor)
        grid = grid_of(rgb, processor)
    except ValueError as e:  # an aspect ratio the model cannot take
        raise ImageError(index, str(e)) from None
    return PromptImage(rgb, grid, image_digest(rgb, grid))


def widen_placeholders(
    ids: list[int], images: Sequence[PromptImage], image_token_id: int, merge: int
) -> list[int]:
    """`ids` with the template's i-th image placeholder repeated as often as image i has
    tokens; 400 when the template wrote another number of placeholders than there are images
    (a chat template that does not render images)."""
    found = ids.count(image_token_id)
    if found != len(images):
        raise ApiError(
            400,
            f"the chat template wrote {found} image placeholders for {len(images)} images: "
            "this model's chat template does not render image_url parts",
            param="messages",
        )
    out: list[int] = []
    counts = iter(image_token_count(image.grid, merge) for image in images)
    for token in ids:
        out.extend([token] * next(counts) if token == image_token_id else [token])
    return out
