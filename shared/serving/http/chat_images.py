"""A chat request's images: its `image_url` content parts made ready for the engine
(shared/serving/images/prompt_images.py) and the chat template's placeholders widened, every
problem answered 400 (413 for an image over the byte limit) naming the image. A text-only model
refuses images rather than dropping them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from shared.engine.requests.multimodal import PromptImage
from shared.model.loader import LoadedModel
from shared.serving.http.errors import ApiError
from shared.serving.http.schemas import ChatMessage
from shared.serving.images.image_errors import ImageError
from shared.serving.images.image_limits import ImageLimits
from shared.serving.images.prompt_images import prompt_images, widen_placeholders


class Prompt(NamedTuple):
    """One prompt of a request: its ids, its text (what echo prepends), its images."""

    ids: list[int]
    text: str
    images: tuple[PromptImage, ...] = ()


def request_images(
    messages: Sequence[ChatMessage], loaded: LoadedModel, limits: ImageLimits, model_name: str
) -> tuple[PromptImage, ...]:
    """The messages' images in order, ready for the engine."""
    urls = [part.image_url.url for m in messages for part in m.image_parts()]
    if not urls:
        return ()
    if loaded.image_processor is None:
        raise ApiError(
            400,
            f"model `{model_name}` takes text only: remove the image_url content parts",
            param="messages",
        )
    try:
        return prompt_images(urls, loaded.image_processor, limits)
    except ImageError as e:
        raise ApiError(e.http_status, str(e), param="messages") from None


def widen_chat_placeholders(
    ids: list[int], images: Sequence[PromptImage], loaded: LoadedModel
) -> list[int]:
    """The rendered chat's ids with each image's placeholder widened; 400 when the chat
    template wrote another number of placeholders than there are images."""
    try:
        return widen_placeholders(ids, images, loaded.config)
    except ValueError as e:
        raise ApiError(
            400,
            f"{e}: this model's chat template does not render image_url parts",
            param="messages",
        ) from None
