"""How much image one request may carry: a bound on count, on bytes, and on decoded pixels."""

from __future__ import annotations

from dataclasses import dataclass

from shared.serving.images.image_errors import ImageError

MIB = 1 << 20


@dataclass(frozen=True)
class ImageLimits:
    """The bounds decode_image_url enforces before it spends memory on an image.

    max_pixels bounds width*height as the file's header declares it, checked before any pixel
    is decoded: a small file can declare a huge picture (a decompression bomb). PIL's own
    ceiling (Image.MAX_IMAGE_PIXELS, about 89 MP) still applies above it.
    """

    max_images: int = 8  # per request
    max_image_bytes: int = 20 * MIB  # per image, after base64 decoding
    max_pixels: int = 40_000_000  # per image, width * height
    # hosts whose http(s) image URLs the node fetches (--allowed-media-domains); none: data
    # URLs only
    allowed_domains: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for name in ("max_images", "max_image_bytes", "max_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ImageLimits.{name} must be a positive integer, got {value!r}")

    def check_count(self, count: int) -> None:
        """Refuse a request with more images than max_images (named as the first one over)."""
        if count > self.max_images:
            raise ImageError(
                self.max_images,
                f"a request may carry at most {self.max_images} images, this one has {count}; "
                "split it into several requests",
            )
