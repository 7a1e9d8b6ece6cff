"""The content key of a preprocessed image, for the prefix cache."""

from __future__ import annotations

import hashlib

import numpy as np

DIGEST_BYTES = 16
_PERSON = b"pdserve.image.v1"  # blake2b's personalisation: no other hash in pdserve can collide


def image_digest(pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> bytes:
    """16-byte blake2b of an image's pixels as the model takes them (resized RGB, or the
    tower's float input), their dtype and shape, and the patch grid.

    Keyed on what the model sees, not on the file: a PNG and a BMP of one picture (or a data
    URL with other parameters) that preprocess to the same pixels share a key, so they share
    cached KV; any differing pixel or grid gives another key.
    """
    pixels = np.ascontiguousarray(pixel_values)
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=_PERSON)
    grid = tuple(int(n) for n in grid_thw)
    h.update(f"{pixels.dtype.str}|{pixels.shape}|{grid}|".encode())
    h.update(pixels)  # the buffer itself, not a bytes copy of it
    return h.digest()
