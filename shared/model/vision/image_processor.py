"""Qwen2-VL's image preprocessing: one RGB picture in, the vision tower's flat patches out.

A reimplementation of transformers' `Qwen2VLImageProcessorPil` (which Qwen2.5-VL reuses) for a
single image, so that serving needs no transformers at run time and produces bit for bit the
same `pixel_values` the model was trained and evaluated with. It uses Pillow (the resize, at the
configured filter, on the uint8 image) and numpy (rescale, normalize, patch reordering): they are
the maintained libraries for this and the ones transformers' PIL backend itself uses; torchvision
is not needed. Every step keeps transformers' dtypes: rescale multiplies in float64 and casts to
float32, normalize works in float32, so the results compare equal, not merely close.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses anything longer and thinner
RESAMPLE_FILTERS = frozenset(int(f) for f in Image.Resampling)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """What a checkpoint's preprocessor_config.json says; the defaults are transformers'."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = int(Image.Resampling.BICUBIC)

    def __post_init__(self) -> None:
        sizes = {
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
        }
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} exceeds max_pixels {self.max_pixels}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std need one value per RGB channel")
        if any(s == 0 for s in self.image_std):
            raise ValueError(f"image_std must not contain 0, got {self.image_std}")
        if self.resample not in RESAMPLE_FILTERS:
            raise ValueError(f"resample must be a PIL filter {sorted(RESAMPLE_FILTERS)}")

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merged patch is factor x factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_preprocessor_config(cls, d: Mapping[str, Any]) -> ImageProcessorConfig:
        """Read a Hugging Face preprocessor_config.json (as a dict); unknown keys are ignored.

        The pixel bounds come, as transformers takes them, from top-level min_pixels/max_pixels
        first, then from size's shortest_edge/longest_edge (the newer spelling), then from
        size's min_pixels/max_pixels (an older one), then the defaults.
        """
        size = d.get("size") or {}
        if not isinstance(size, Mapping):
            raise ValueError(f"preprocessor config 'size' must be a mapping, got {size!r}")
        defaults = cls()

        def pick(*values: Any, default: Any) -> Any:
            return next((v for v in values if v is not None), default)

        return cls(
            patch_size=int(d.get("patch_size", defaults.patch_size)),
            temporal_patch_size=int(d.get("temporal_patch_size", defaults.temporal_patch_size)),
            merge_size=int(d.get("merge_size", defaults.merge_size)),
            min_pixels=int(
                pick(
                    d.get("min_pixels"),
                    size.get("shortest_edge"),
                    size.get("min_pixels"),
                    default=defaults.min_pixels,
                )
            ),
            max_pixels=int(
                pick(
                    d.get("max_pixels"),
                    size.get("longest_edge"),
                    size.get("max_pixels"),
                    default=defaults.max_pixels,
                )
            ),
            image_mean=_per_channel(d.get("image_mean"), defaults.image_mean),
            image_std=_per_channel(d.get("image_std"), defaults.image_std),
            rescale_factor=float(pick(d.get("rescale_factor"), default=defaults.rescale_factor)),
            do_resize=bool(pick(d.get("do_resize"), default=True)),
            do_rescale=bool(pick(d.get("do_rescale"), default=True)),
            do_normalize=bool(pick(d.get("do_normalize"), default=True)),
            do_convert_rgb=bool(pick(d.get("do_convert_rgb"), default=True)),
            resample=int(pick(d.get("resample"), default=defaults.resample)),
        )


def _per_channel(value: float | Sequence[float] | None, default: tuple[float, ...]) -> tuple:
    """transformers accepts one number for all channels or one per channel."""
    if value is None:
        return default
    if isinstance(value, int | float):
        return (float(value),) * 3
    return tuple(float(v) for v in value)


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the vision tower takes it.

    pixel_values is [t*h*w, C*temporal_patch*patch*patch] float32, rows in merge order (each run
    of merge_size**2 rows is one merged token); grid_thw counts patches, not merged tokens.
    """

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    num_tokens: int  # placeholder tokens the prompt carries for this image


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 14 * 14 * 4 * 1280,
) -> tuple[int, int]:
    """transformers' smart_resize, line for line (Python's round, half to even, included).

    Both sides become multiples of factor, the area lands in [min_pixels, max_pixels] and the
    aspect ratio is kept as nearly as that allows. Raises ValueError, worded for an API client,
    for an empty side or an aspect ratio over 200:1, as transformers does.
    """
    if height < 1 or width < 1:
        raise ValueError(f"the image is {width}x{height} pixels; it needs at least one pixel")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"the image is {width}x{height} pixels, an aspect ratio over {MAX_ASPECT_RATIO}:1; "
            "crop or pad it to a less extreme shape"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def convert_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb for a PIL image: anything with an alpha band (or a
    transparency key: a palette GIF's, an RGB PNG's tRNS) is composited onto opaque white,
    everything else goes through PIL's own convert("RGB")."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def preprocess(image: Image.Image, config: ImageProcessorConfig) -> ProcessedImage:
    """What Qwen2VLImageProcessorPil makes of one image: RGB, resize, rescale, normalize,
    then the temporal repeat and the patch/merge reordering."""
    return pixel_values(resized_rgb(image, config), config)


def resized_rgb(image: Image.Image, config: ImageProcessorConfig) -> np.ndarray:
    """The image as RGB at the size the model takes it: [H, W, 3] uint8, both sides multiples
    of `config.factor`. Everything after this step is arithmetic on these bytes, so they are
    what a request carries (an eighth of the float pixels) and what its content key hashes."""
    if config.do_convert_rgb:
        image = convert_rgb(image)
    elif image.mode != "RGB":
        # transformers would carry the raw bands on and fail (or mislabel them) later.
        raise ValueError(f"do_convert_rgb is off but the image is {image.mode}, not RGB")
    if config.do_resize:
        height, width = smart_resize(
            image.height, image.width, config.factor, config.min_pixels, config.max_pixels
        )
        # transformers resizes the uint8 image with PIL (reducing_gap None) at this filter.
        image = image.resize((width, height), resample=config.resample)
    return np.asarray(image)


def grid_of(rgb: np.ndarray, config: ImageProcessorConfig) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of a resized image; ValueError when its sides are not
    multiples of the merged patch."""
    height, width = rgb.shape[:2]
    if rgb.ndim != 3 or rgb.shape[2] != 3 or height % config.factor or width % config.factor:
        raise ValueError(
            f"the image is {width}x{height} pixels ({rgb.shape}), not RGB with sides multiple "
            f"of {config.factor}; enable do_resize or send an image of that shape"
        )
    return 1, height // config.patch_size, width // config.patch_size


def pixel_values(rgb: np.ndarray, config: ImageProcessorConfig) -> ProcessedImage:
    """The vision tower's input from a resized image: rescale, normalize, patchify."""
    pixels: np.ndarray = rgb
    if config.do_rescale:
        pixels = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    if config.do_normalize:
        if not np.issubdtype(pixels.dtype, np.floating):
            pixels = pixels.astype(np.float32)
        mean = np.array(config.image_mean, dtype=pixels.dtype)
        std = np.array(config.image_std, dtype=pixels.dtype)
        pixels = (pixels - mean) / std
    channels_first = np.asarray(pixels, dtype=np.float32).transpose(2, 0, 1)
    return _patchify(channels_first, config)


def _patchify(image: np.ndarray, config: ImageProcessorConfig) -> ProcessedImage:
    """[C, H, W] -> [grid_h*grid_w, C*tp*p*p], rows grouped by merge window, each patch's values
    as (channel, temporal copy, row, column): the order the vision tower's Conv3d unrolls."""
    patch, merge, temporal = config.patch_size, config.merge_size, config.temporal_patch_size
    channels, height, width = image.shape
    if height % config.factor or width % config.factor:
        raise ValueError(
            f"the image is {width}x{height} pixels, not a multiple of {config.factor} on each "
            "side; enable do_resize or send an image of that shape"
        )
    grid_h, grid_w = height // patch, width // patch
    patches = image.reshape(
        channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch
    ).transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
    # A still picture is one frame: repeated temporal_patch_size times along a new axis after C.
    repeated = np.broadcast_to(
        patches[:, :, :, :, :, None], (*patches.shape[:5], temporal, patch, patch)
    )
    flat = np.ascontiguousarray(
        repeated.reshape(grid_h * grid_w, channels * temporal * patch * patch)
    )
    return ProcessedImage(
        pixel_values=flat,
        grid_thw=(1, grid_h, grid_w),
        num_tokens=grid_h * grid_w // (merge * merge),
    )
