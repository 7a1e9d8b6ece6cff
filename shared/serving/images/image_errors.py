"""Why a request's image was refused, worded for the API client who sent it."""

from __future__ import annotations

from typing import ClassVar


class ImageError(ValueError):
    """An image the server will not take: the client's fault, answered with a 400.

    The message names the image ("image 2: ...", counting from 1 in the order the request
    carries them) and says what to send instead; it never echoes the image data back.
    """

    http_status: ClassVar[int] = 400

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"image {index + 1}: {reason}")
        self.index = index  # from 0, the request's order of images
        self.reason = reason


class ImageTooLargeError(ImageError):
    """The encoded image is over the byte limit: answered with a 413, as for a too-large body."""

    http_status: ClassVar[int] = 413
