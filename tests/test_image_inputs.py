"""A client's image to the model's pixels: decoding a data URL (and every way it is refused),
Qwen2-VL preprocessing bit for bit against transformers' PIL processor, and the content key."""

from __future__ import annotations

import base64
import http.server
import io
import resource
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image, ImageFile
from transformers import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)

from shared.model.vision.image_processor import (
    ImageProcessorConfig,
    convert_rgb,
    preprocess,
    smart_resize,
)
from shared.serving.images.image_decode import decode_image_url
from shared.serving.images.image_errors import ImageError, ImageTooLargeError
from shared.serving.images.image_hash import image_digest
from shared.serving.images.image_limits import ImageLimits

LIMITS = ImageLimits()


def rng_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (height, width, bands), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if bands == 1 else arr, mode=mode)


def encode(image: Image.Image, fmt: str, **save: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **save)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_only(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR declaring width x height RGB, with a tiny IDAT: a bomb."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", idat)
        + png_chunk(b"IEND", b"")
    )


def transformers_output(image: Image.Image, config: ImageProcessorConfig) -> tuple:
    hf = Qwen2VLImageProcessorPil(
        min_pixels=config.min_pixels,
        max_pixels=config.max_pixels,
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        merge_size=config.merge_size,
        resample=config.resample,
        do_normalize=config.do_normalize,
        do_rescale=config.do_rescale,
    )
    out = hf(images=image, return_tensors="np")
    return out["pixel_values"], tuple(int(n) for n in out["image_grid_thw"][0])


def assert_parity(image: Image.Image, config: ImageProcessorConfig) -> None:
    ours = preprocess(image, config)
    hf_pixels, hf_grid = transformers_output(image, config)
    assert ours.grid_thw == hf_grid
    assert ours.pixel_values.dtype == np.float32 == hf_pixels.dtype
    np.testing.assert_array_equal(ours.pixel_values, hf_pixels)  # bit for bit, not allclose
    assert ours.num_tokens == hf_grid[0] * hf_grid[1] * hf_grid[2] // config.merge_size**2


# ---- preprocessing: parity with transformers ------------------------------------------------
DEFAULT = ImageProcessorConfig()
DOWNSCALE = ImageProcessorConfig(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
UPSCALE = ImageProcessorConfig(min_pixels=28 * 28 * 120, max_pixels=28 * 28 * 400)
BILINEAR_RAW = ImageProcessorConfig(resample=2, do_normalize=False)


@pytest.mark.parametrize("config", [DEFAULT, DOWNSCALE, UPSCALE, BILINEAR_RAW])
@pytest.mark.parametrize(("width", "height"), [(56, 56), (100, 37), (333, 500)])
def test_preprocess_matches_transformers_on_rgb(
    config: ImageProcessorConfig, width: int, height: int
) -> None:
    assert_parity(rng_image(width, height, seed=width), config)


def palette_gif_with_transparency() -> Image.Image:
    image = rng_image(90, 61, seed=3).quantize(colors=16)
    image.info["transparency"] = 5
    return Image.open(io.BytesIO(encode(image, "GIF", transparency=5)))


@pytest.mark.parametrize(
    "make",
    [
        lambda: rng_image(120, 77, "RGBA", seed=1),
        lambda: rng_image(64, 200, "L", seed=2),
        palette_gif_with_transparency,
        lambda: Image.open(io.BytesIO(encode(rng_image(150, 98, seed=4), "JPEG", quality=80))),
        lambda: rng_image(40, 30, "RGB", seed=5).convert("CMYK"),
    ],
    ids=["rgba", "L", "palette-gif", "jpeg", "cmyk"],
)
@pytest.mark.parametrize("config", [DEFAULT, DOWNSCALE], ids=["default", "downscale"])
def test_preprocess_matches_transformers_on_other_modes(make, config) -> None:
    assert_parity(make(), config)


def test_decoded_data_url_preprocesses_as_transformers_does_the_file() -> None:
    rgba = rng_image(100, 37, "RGBA", seed=7)
    data = encode(rgba, "PNG")
    decoded = decode_image_url(data_url(data), LIMITS, 0)
    assert decoded.mode == "RGB"
    ours = preprocess(decoded, DEFAULT).pixel_values
    np.testing.assert_array_equal(
        ours, transformers_output(Image.open(io.BytesIO(data)), DEFAULT)[0]
    )


def test_rgba_is_composited_onto_white_as_transformers_does() -> None:
    arr = np.zeros((2, 2, 4), dtype=np.uint8)
    arr[0, 0] = (10, 20, 30, 0)  # fully transparent: white, not the hidden colour
    arr[0, 1] = (10, 20, 30, 255)  # opaque: itself
    arr[1, 0] = (0, 0, 0, 128)  # half: halfway to white
    rgb = np.asarray(convert_rgb(Image.fromarray(arr, mode="RGBA")))
    assert rgb[0, 0].tolist() == [255, 255, 255]
    assert rgb[0, 1].tolist() == [10, 20, 30]
    assert rgb[1, 0].tolist() == [127, 127, 127]


def test_layout_is_merge_windows_of_channel_temporal_row_column() -> None:
    """One merged token is merge**2 consecutive rows; each row is (C, t, ph, pw) flattened."""
    config = ImageProcessorConfig(do_rescale=False, do_normalize=False, do_resize=False)
    arr = np.arange(56 * 56 * 3, dtype=np.uint32).reshape(56, 56, 3) % 251
    out = preprocess(Image.fromarray(arr.astype(np.uint8)), config)
    assert out.grid_thw == (1, 4, 4) and out.num_tokens == 4
    assert out.pixel_values.shape == (16, 3 * 2 * 14 * 14)
    second = out.pixel_values[1].reshape(3, 2, 14, 14)  # token 0's top-right patch
    np.testing.assert_array_equal(second[:, 0], arr[:14, 14:28].transpose(2, 0, 1))
    np.testing.assert_array_equal(second[:, 0], second[:, 1])  # a still frame, repeated


# ---- configuration ---------------------------------------------------------------------------
def test_config_defaults_are_transformers() -> None:
    hf = Qwen2VLImageProcessorPil()
    ours = ImageProcessorConfig.from_preprocessor_config({})
    assert (ours.min_pixels, ours.max_pixels) == (hf.size.shortest_edge, hf.size.longest_edge)
    assert ours.image_mean == hf.image_mean and ours.image_std == hf.image_std
    assert ours.rescale_factor == hf.rescale_factor and ours.resample == int(hf.resample)
    assert (ours.patch_size, ours.temporal_patch_size, ours.merge_size) == (14, 2, 2)


def test_config_reads_both_spellings_of_the_pixel_bounds() -> None:
    qwen25 = {  # Qwen2.5-VL-7B-Instruct's preprocessor_config.json
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
    }
    config = ImageProcessorConfig.from_preprocessor_config(qwen25)
    assert (config.min_pixels, config.max_pixels) == (3136, 12845056)
    newer = {"size": {"shortest_edge": 1000, "longest_edge": 20000}}
    config = ImageProcessorConfig.from_preprocessor_config(newer)
    assert (config.min_pixels, config.max_pixels) == (1000, 20000)
    # top-level min/max_pixels win over size, as Qwen2VLImageProcessorPil.__init__ has it
    both = {**newer, "max_pixels": 50000, "resample": 2, "do_normalize": False}
    config = ImageProcessorConfig.from_preprocessor_config(both)
    assert (config.min_pixels, config.max_pixels, config.resample) == (1000, 50000, 2)
    assert not config.do_normalize
    with pytest.raises(ValueError, match="exceeds max_pixels"):
        ImageProcessorConfig.from_preprocessor_config({"min_pixels": 10, "max_pixels": 5})


# ---- smart_resize ----------------------------------------------------------------------------
SIZES = [(1, 1), (1, 150), (10, 10), (27, 29), (56, 56), (14, 2800), (28, 5600), (4000, 3000)]
SIZES += [(37, 100), (500, 333), (3000, 20), (8192, 8192)]


@pytest.mark.parametrize(("height", "width"), SIZES)
@pytest.mark.parametrize("bounds", [(3136, 1003520), (784, 12544), (94080, 313600)])
def test_smart_resize_is_transformers(height: int, width: int, bounds: tuple[int, int]) -> None:
    assert smart_resize(height, width, 28, *bounds) == hf_smart_resize(height, width, 28, *bounds)


def test_smart_resize_refuses_extreme_aspect_ratio_like_transformers() -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        hf_smart_resize(10, 2001)
    with pytest.raises(ValueError, match=r"aspect ratio over 200:1; crop or pad"):
        smart_resize(10, 2001)
    assert smart_resize(10, 2000)  # exactly 200:1 is taken by both
    with pytest.raises(ValueError, match="at least one pixel"):
        smart_resize(0, 10)


# ---- decoding and its refusals ---------------------------------------------------------------
def refusal(url: str, limits: ImageLimits = LIMITS) -> ImageError:
    with pytest.raises(ImageError) as caught:
        decode_image_url(url, limits, 1)
    assert str(caught.value).startswith("image 2: ")  # says which image, counting from 1
    return caught.value


def test_png_jpeg_webp_gif_bmp_decode_to_rgb() -> None:
    image = rng_image(33, 21, seed=9)
    for fmt, media in [("PNG", "png"), ("BMP", "bmp"), ("WEBP", "webp"), ("GIF", "gif")]:
        decoded = decode_image_url(data_url(encode(image, fmt), f"image/{media}"), LIMITS, 0)
        assert decoded.mode == "RGB" and decoded.size == (33, 21)
    jpeg = data_url(encode(image, "JPEG"), "IMAGE/JPG;name=x")  # case, alias, parameters
    assert decode_image_url(jpeg, LIMITS, 0).size == (33, 21)


def test_animated_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50)
    decoded = decode_image_url(data_url(buf.getvalue(), "image/gif"), LIMITS, 0)
    assert np.asarray(decoded)[0, 0].tolist() == [255, 0, 0]


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: a phone held upright
    data = encode(rng_image(40, 20, seed=2), "JPEG", exif=exif)
    assert decode_image_url(data_url(data, "image/jpeg"), LIMITS, 0).size == (20, 40)


def test_sixteen_bit_grayscale_keeps_its_levels() -> None:
    levels = np.array([[0, 0x1234, 0x8000, 0xFFFF]], dtype=np.uint16)
    data = encode(Image.fromarray(levels), "PNG")
    rgb = np.asarray(decode_image_url(data_url(data), LIMITS, 0))
    assert rgb[0, :, 0].tolist() == [0, 0x12, 0x80, 0xFF]  # PIL's convert would clip to 255


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("data:text/plain;base64,aGVsbG8=", "'text/plain', not an image"),
        ("data:image/tiff;base64,aGVsbG8=", "'image/tiff' is not supported"),
        ("data:image/png;base64", "no ','"),
        ("data:image/png,aGVsbG8=", "must be base64-encoded"),
        ("data:image/png;base64,", "carries no data"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png;base64,aGVsbG8", "not valid base64"),  # padding missing
        ("data:image/png;base64,aGVs\nbG8=", "not valid base64"),
        ("data:image/png;base64,aGVsbG8=", "not an image this server reads"),
        ("file:///etc/passwd", "must be a data URL"),
    ],
)
def test_malformed_data_urls_are_refused_precisely(url: str, says: str) -> None:
    error = refusal(url)
    assert says in str(error) and type(error) is ImageError and error.http_status == 400


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_file_is_refused(fmt: str) -> None:
    data = encode(rng_image(64, 64, seed=1), fmt)
    assert "corrupt or truncated" in str(refusal(data_url(data[: len(data) * 2 // 3])))


def test_remote_urls_are_refused_with_what_to_send() -> None:
    assert "does not fetch images from that host" in str(refusal("https://example.com/cat.png"))
    assert "data URL" in str(refusal("http://example.com/cat.png"))
    other = ImageLimits(allowed_domains=frozenset({"images.example.org"}))
    assert "that host" in str(refusal("https://example.com/cat.png", other))


@pytest.fixture
def image_server() -> Iterator[str]:
    """http://127.0.0.1:PORT serving /cat.png (a PNG), /moved (a redirect to it), /big (2 MiB)
    and /gone (404)."""
    png = encode(rng_image(40, 30, seed=5), "PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            routes = {"/cat.png": (200, png), "/big": (200, b"x" * (2 << 20))}
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "/cat.png")
                self.end_headers()
                return
            status, body = routes.get(self.path, (404, b""))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_allowed_hosts_are_fetched_within_bounds(image_server: str) -> None:
    """The operator's hosts only; no redirect followed; the byte limit stops the download."""
    limits = ImageLimits(max_image_bytes=1 << 20, allowed_domains=frozenset({"127.0.0.1"}))
    fetched = decode_image_url(f"{image_server}/cat.png", limits, 0)
    assert fetched.size == (40, 30) and fetched.mode == "RGB"
    assert "answered 302" in str(refusal(f"{image_server}/moved", limits))
    assert "answered 404" in str(refusal(f"{image_server}/gone", limits))
    assert "over 1048576 bytes" in str(refusal(f"{image_server}/big", limits))
    assert "that host" in str(refusal(f"{image_server}/cat.png"))  # not allowed: not fetched


def test_too_many_bytes_is_a_413() -> None:
    data = encode(rng_image(64, 64, seed=1), "PNG")
    limits = ImageLimits(max_image_bytes=len(data) - 1)
    error = refusal(data_url(data), limits)
    assert isinstance(error, ImageTooLargeError) and error.http_status == 413
    huge = "data:image/png;base64," + "A" * (8 << 20)  # refused from its length alone
    assert isinstance(refusal(huge, ImageLimits(max_image_bytes=1 << 20)), ImageTooLargeError)
    assert decode_image_url(data_url(data), ImageLimits(max_image_bytes=len(data)), 0)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


@pytest.mark.parametrize(
    ("side", "limits"),
    [
        (40_000, LIMITS),  # 1.6 GP: over PIL's own bomb limit, refused inside Image.open
        (8_000, LIMITS),  # 64 MP: under PIL's, over ours
        (9_500, ImageLimits(max_pixels=100_000_000)),  # PIL's warning zone, under ours
    ],
)
def test_decompression_bomb_is_refused_fast_without_allocating(side, limits, monkeypatch) -> None:
    url = data_url(png_header_only(side, side))
    decoded: list[object] = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda im: decoded.append(im))
    before = peak_rss_mib()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL's DecompressionBombWarning must not leak either
        error = refusal(url, limits)
    assert time.perf_counter() - start < 1.0
    assert decoded == []  # refused from the header: no pixel data was decoded
    assert peak_rss_mib() - before < 100  # the pixels would be side*side*3 bytes
    assert "pixels" in str(error) and error.http_status == 400


def test_image_count_limit() -> None:
    ImageLimits(max_images=2).check_count(2)
    with pytest.raises(ImageError, match="at most 2 images, this one has 3"):
        ImageLimits(max_images=2).check_count(3)
    with pytest.raises(ValueError, match="max_pixels"):
        ImageLimits(max_pixels=0)


# ---- the content key -------------------------------------------------------------------------
def test_digest_follows_the_pixels_not_the_encoding() -> None:
    image = rng_image(100, 37, seed=11)
    as_png = decode_image_url(data_url(encode(image, "PNG")), LIMITS, 0)
    as_bmp = decode_image_url(data_url(encode(image, "BMP"), "image/bmp"), LIMITS, 0)
    a, b = preprocess(as_png, DEFAULT), preprocess(as_bmp, DEFAULT)
    key = image_digest(a.pixel_values, a.grid_thw)
    assert len(key) == 16 and key == image_digest(b.pixel_values, b.grid_thw)
    assert key == image_digest(a.pixel_values.copy(), list(a.grid_thw))  # stable
    changed = np.asarray(image).copy()
    changed[5, 5, 0] ^= 1
    c = preprocess(Image.fromarray(changed), DEFAULT)
    assert image_digest(c.pixel_values, c.grid_thw) != key
    assert image_digest(a.pixel_values, (1, a.grid_thw[2], a.grid_thw[1])) != key
