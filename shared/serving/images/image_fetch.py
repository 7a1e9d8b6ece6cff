"""Remote images, for the hosts an operator allows (`--allowed-media-domains`), and only those:
the server fetches nothing else, so a client cannot make it reach into the operator's network.

One GET with httpx (the maintained client the HTTP tests already use), never following a
redirect (it could leave the allowed hosts), stopped as soon as the body passes the byte limit,
within a deadline. Any failure is the client's 400 naming the image.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from shared.serving.images.image_errors import ImageError
from shared.serving.images.image_limits import ImageLimits

FETCH_TIMEOUT_S = 10.0  # connect, each read and the whole body


def fetch_allowed(url: str, limits: ImageLimits, index: int) -> bytes | None:
    """The body at an http(s) `url` whose host the operator allows; None when it is not such
    a URL (the caller refuses it)."""
    try:
        parts = urlsplit(url)
        scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    except ValueError:
        return None
    if scheme not in ("http", "https") or host not in limits.allowed_domains:
        return None
    try:
        with (
            httpx.Client(timeout=FETCH_TIMEOUT_S, follow_redirects=False) as client,
            client.stream("GET", url) as reply,
        ):
            if reply.status_code != 200:
                raise ImageError(
                    index, f"fetching the image from {host} answered {reply.status_code}"
                )
            return _body(reply, limits, index)
    except httpx.HTTPError as e:
        raise ImageError(
            index, f"could not fetch the image from {host} ({type(e).__name__})"
        ) from None


def _body(reply: httpx.Response, limits: ImageLimits, index: int) -> bytes:
    data = bytearray()
    for chunk in reply.iter_bytes():
        data += chunk
        if len(data) > limits.max_image_bytes:
            raise ImageError(index, f"the image at that URL is over {limits.max_image_bytes} bytes")
    return bytes(data)
