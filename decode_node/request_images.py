"""A gRPC GenerateRequest's images (generation.proto's ImageInput), made ready for the engine as
the HTTP API makes a chat's (shared/serving/images/prompt_images.py), every problem
INVALID_ARGUMENT naming the image."""

from __future__ import annotations

from proto.pdserve.v1 import generation_pb2
from shared.engine.info import EngineInfo
from shared.engine.requests.multimodal import PromptImage
from shared.serving.grpc_server import GenerateError, image_placeholder
from shared.serving.images.image_errors import ImageError
from shared.serving.images.image_limits import ImageLimits
from shared.serving.images.prompt_images import ImageSource, prompt_images, widen_placeholders
from shared.serving.status import Status


def request_images(
    info: EngineInfo, request: generation_pb2.GenerateRequest, limits: ImageLimits
) -> tuple[PromptImage, ...]:
    """The request's images in order (CPU work: run it off the event loop)."""
    if not request.images:
        return ()
    processor = info.loaded.image_processor
    if processor is None:
        raise GenerateError(
            Status.INVALID_ARGUMENT, f"images: model {info.loaded.name} takes text only"
        )
    sources: list[ImageSource] = []
    for i, image in enumerate(request.images):
        which = image.WhichOneof("source")
        if which is None:
            raise GenerateError(Status.INVALID_ARGUMENT, f"image {i + 1}: set data or url")
        sources.append(image.data if which == "data" else image.url)
    try:
        return prompt_images(sources, processor, limits)
    except ImageError as e:
        raise GenerateError(Status.INVALID_ARGUMENT, str(e)) from None


def widen(info: EngineInfo, prompt: list[int], images: tuple[PromptImage, ...]) -> list[int]:
    """The prompt with each image's placeholder widened to the image's tokens."""
    try:
        return widen_placeholders(prompt, images, info.loaded.config)
    except ValueError as e:
        token = info.loaded.config.image_token_id
        raise GenerateError(
            Status.INVALID_ARGUMENT,
            f"{e}: put the model's image placeholder ({image_placeholder(info)!r}, token id "
            f"{token}) in the prompt once per image",
        ) from None
