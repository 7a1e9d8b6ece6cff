"""A client's image_url, as the OpenAI API carries it, decoded into a checked RGB picture.

Only data URLs are taken: the server fetches nothing from the network. Every refusal is an
ImageError whose message tells the client which image and what to send instead. The picture's
size is checked from the file header before any pixel is decoded, so a small file declaring a
huge picture (a decompression bomb) costs neither time nor memory.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from urllib.parse import urlsplit

import numpy as np
from PIL import Image, ImageOps

from shared.model.vision.image_processor import convert_rgb
from shared.serving.images.image_errors import ImageError, ImageTooLargeError
from shared.serving.images.image_fetch import fetch_allowed
from shared.serving.images.image_limits import ImageLimits

# The media types a data URL may declare, and the decoders PIL may use on any of them: PIL is
# never let near its other formats (EPS would run Ghostscript), whatever the bytes look like.
MEDIA_TYPES = frozenset(
    {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp"}
)
PIL_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
SENDABLE = "PNG, JPEG, WebP, GIF or BMP"
EXAMPLE = "data:image/png;base64,<the file's bytes in base64>"
SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})


def decode_image_url(url: str, limits: ImageLimits, index: int) -> Image.Image:
    """The RGB picture a data URL carries (an animation's first frame), or one fetched from a
    host the operator allows (`limits.allowed_domains`), or an ImageError.

    index is the image's position among the request's images, from 0 (messages count from 1).
    """
    if url[:5].lower() != "data:":
        fetched = fetch_allowed(url, limits, index)
        if fetched is None:
            raise _remote_refusal(url, index)
        return decode_image_bytes(fetched, limits, index)
    payload = _base64_payload(url, index)
    # Refuse an oversized image from the encoded length alone, before decoding a byte of it.
    if len(payload) > 4 * -(-limits.max_image_bytes // 3):
        raise _too_large(index, limits)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(
            index,
            "the data URL's payload is not valid base64 (standard alphabet, '=' padding, no "
            "line breaks or spaces); encode the file's bytes with standard base64",
        ) from None
    if len(data) > limits.max_image_bytes:
        raise _too_large(index, limits)
    return _to_rgb(_open(data, limits, index), index)


def decode_image_bytes(data: bytes, limits: ImageLimits, index: int) -> Image.Image:
    """The RGB picture an encoded file holds (gRPC's ImageInput.data), or an ImageError."""
    if len(data) > limits.max_image_bytes:
        raise _too_large(index, limits)
    return _to_rgb(_open(data, limits, index), index)


def _remote_refusal(url: str, index: int) -> ImageError:
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError:
        scheme = ""
    if scheme not in ("http", "https"):
        return ImageError(index, f"image_url must be a data URL ({EXAMPLE})")
    return ImageError(
        index,
        f"this server does not fetch images from that host; send the image inline as a data URL "
        f"({EXAMPLE})",
    )


def _base64_payload(url: str, index: int) -> str:
    """The base64 text of `data:<media type>[;parameters];base64,<text>`."""
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ImageError(index, f"the data URL has no ',' before its data; expected {EXAMPLE}")
    params = [p.strip().lower() for p in header.split(";")]
    media_type = params[0]
    if not media_type.startswith("image/"):
        shown = media_type[:40] or "no media type"
        raise ImageError(index, f"the data URL declares {shown!r}, not an image; send {SENDABLE}")
    if media_type not in MEDIA_TYPES:
        raise ImageError(index, f"{media_type[:40]!r} is not supported; send {SENDABLE}")
    if len(params) < 2 or params[-1] != "base64":
        raise ImageError(index, f"the data URL must be base64-encoded; expected {EXAMPLE}")
    if not payload:
        raise ImageError(index, "the data URL carries no data")
    return payload


def _too_large(index: int, limits: ImageLimits) -> ImageTooLargeError:
    return ImageTooLargeError(
        index,
        f"the image is over {limits.max_image_bytes} bytes; send a smaller or more compressed one",
    )


def _too_many_pixels(index: int, limit: int, size: str = "") -> ImageError:
    declared = f"is {size} pixels, over" if size else "declares more than"
    return ImageError(
        index,
        f"the image {declared} the {limit} pixels this server decodes; scale it down before "
        "sending",
    )


def _open(data: bytes, limits: ImageLimits, index: int) -> Image.Image:
    """Open, check the declared size, then (only then) decode the pixels of the first frame."""
    try:
        # PIL's own bomb check runs inside Image.open: its warning is made an error here so
        # that neither it nor DecompressionBombError leaves as anything but an ImageError.
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=PIL_FORMATS)
            width, height = image.size
            if width * height > limits.max_pixels:
                raise _too_many_pixels(index, limits.max_pixels, f"{width}x{height}")
            image.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # Pillow's ceiling (Image.MAX_IMAGE_PIXELS) is the lower one here.
        limit = min(limits.max_pixels, Image.MAX_IMAGE_PIXELS or limits.max_pixels)
        raise _too_many_pixels(index, limit) from None
    except Image.UnidentifiedImageError:
        raise ImageError(
            index, f"the data is not an image this server reads (corrupt, or not {SENDABLE})"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as exc:
        raise ImageError(
            index, f"the image data is corrupt or truncated ({exc}); send the whole, valid file"
        ) from None
    return image


def _to_rgb(image: Image.Image, index: int) -> Image.Image:
    """Upright (EXIF orientation applied, as transformers' load_image does), then RGB as the
    image processor's convert_rgb makes it: transparency composited onto white."""
    try:
        ImageOps.exif_transpose(image, in_place=True)
    except (OSError, SyntaxError, ValueError, KeyError, TypeError) as exc:
        raise ImageError(index, f"the image's EXIF data is corrupt ({exc})") from None
    if image.mode in SIXTEEN_BIT_MODES:
        # PIL's convert would clip every 16-bit level above 255 to white: keep the top 8 bits.
        image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8), mode="L")
    return convert_rgb(image)
