"""Images through the OpenAI API and gRPC of a tiny Qwen2-VL, colocated and split (a prefill
node runs the vision tower and the prompt, the decode node the rest): PNG images of different
sizes (data URLs, a file's bytes), preprocessed by the decode node and answered token for token
as transformers answers with its own processor; usage and /tokenize count the image tokens; bad
images are 400 (413 past the byte limit) naming the image, INVALID_ARGUMENT over gRPC; the node
keeps serving with every seat, block and mRoPE delta row back on every node."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer

from decode_node.config import DecodeNodeConfig
from decode_node.server import DecodeNode
from encode_node.config import EncodeNodeConfig
from encode_node.server import EncodeNode
from pdserve.client import create_channel
from prefill_node.config import PrefillNodeConfig
from prefill_node.server import PrefillNode
from proto.pdserve.v1 import (
    encoder_pb2,
    encoder_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
)
from shared.engine.config import EngineConfig
from shared.model.loader import load_model
from tests.engine_helpers import single_torch_thread
from tests.support.cluster import PdCluster
from tests.support.vision_checkpoints import (
    MAX_PIXELS,
    MERGE,
    MIN_PIXELS,
    PATCH,
    QWEN2_5_VL,
    QWEN2_VL,
    TEMPORAL,
    build_vl_checkpoint,
    hf_vl_generate,
)
from tests.up_process import start_up

NEW_TOKENS = 5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vl-api")
    return {arch: build_vl_checkpoint(root, arch) for arch in (QWEN2_VL, QWEN2_5_VL)}


@pytest.fixture(scope="module")
def checkpoint(checkpoints: dict[str, Path]) -> Path:
    return checkpoints[QWEN2_VL]


def _png(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _bomb_url() -> str:
    """A PNG whose header claims 40,000 x 40,000 pixels (its data is a few bytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", 40_000, 40_000, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0"))
    return "data:image/png;base64," + base64.b64encode(png + chunk(b"IEND", b"")).decode()


def _expected(
    checkpoint: Path, text: str, images: list[Image.Image]
) -> tuple[list[int], list[int]]:
    """transformers' prompt ids (its processor widens the placeholders) and greedy answer."""
    import transformers

    processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        temporal_patch_size=TEMPORAL,
        merge_size=MERGE,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )
    vision: dict[str, torch.Tensor] = {}
    if images:
        inputs = processor(images=images, return_tensors="pt")
        vision = {
            "pixel_values": inputs["pixel_values"],
            "image_grid_thw": inputs["image_grid_thw"],
        }
    pads = iter(int(g.prod()) // MERGE**2 for g in vision.get("image_grid_thw", []))
    chat = "<|im_start|>user\n" + text + "<|im_end|>\n<|im_start|>assistant\n"
    parts = chat.split("<|image_pad|>")
    widened = parts[0] + "".join("<|image_pad|>" * next(pads) + p for p in parts[1:])
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    ids = tokenizer.encode(widened, add_special_tokens=False).ids
    model = getattr(transformers, checkpoint.name).from_pretrained(checkpoint, dtype=torch.float32)
    pixels, grids = vision.get("pixel_values"), vision.get("image_grid_thw")
    return ids, hf_vl_generate(model, ids, pixels, grids, NEW_TOKENS)


COLOCATED, PD, EPD = "colocated", "pd", "epd"
SPLITS = [COLOCATED, PD, EPD]


async def _serve(checkpoint: Path, body, split: str = COLOCATED) -> None:
    """`body(client, grpc target)` against a colocated node, or a decode node whose every
    prompt a prefill node computes (`pd`), that one's images encoded by an encoder node
    (`epd`); fp32 everywhere, so the answers can be compared to transformers'."""
    engine = EngineConfig(model=str(checkpoint), num_kv_blocks=256, block_size=8, dtype="float32")
    cluster = PdCluster([], [])
    encoder = None
    try:
        if split == EPD:
            encoder = EncodeNode(EncodeNodeConfig(model=str(checkpoint), dtype="float32", port=0))
            await encoder.start()
        if split != COLOCATED:
            targets = () if encoder is None else (f"127.0.0.1:{encoder.port}",)
            prefill = PrefillNode(
                PrefillNodeConfig(engine=engine, port=0, metrics_port=0, encoder_targets=targets),
                load_model(str(checkpoint), dtype=torch.float32),
            )
            cluster.prefills.append(prefill)
            await prefill.start()
        decode = await _decode_node(checkpoint, engine, cluster)
        url = f"http://127.0.0.1:{decode.http_port}"
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await body(client, f"127.0.0.1:{decode.port}")
        await cluster.assert_idle_and_conserved()
        await _check_where(cluster, split, encoder)
    finally:
        for node in [*cluster.decodes, *cluster.prefills, *([encoder] if encoder else [])]:
            await node.stop(grace=1.0)


async def _decode_node(checkpoint: Path, engine: EngineConfig, cluster: PdCluster) -> DecodeNode:
    config = DecodeNodeConfig(
        engine=engine,
        prefill_targets=tuple(f"127.0.0.1:{p.port}" for p in cluster.prefills),
        port=0,
        metrics_port=0,
        http_port=0,
        colocated=not cluster.prefills,
        local_prefill_tokens=0,
        local_prefill_fallback=False,
    )
    decode = DecodeNode(config, load_model(str(checkpoint), dtype=torch.float32))
    cluster.decodes.append(decode)
    await decode.start()
    return decode


async def _check_where(cluster: PdCluster, split: str, encoder: EncodeNode | None) -> None:
    """Every prompt went to the prefill node (split); every image to the encoder (E/P/D)."""
    if split == COLOCATED:
        return
    prefill_metrics, decode_metrics = await asyncio.to_thread(cluster.metrics)
    assert decode_metrics.get('pdserve_prefills_total{where="local"}', 0.0) == 0
    assert decode_metrics['pdserve_prefills_total{where="remote"}'] > 0
    clients = cluster.prefills[0].encoders
    if encoder is not None:
        assert clients is not None and clients.remote_images > 0 and clients.local_images == 0
        # over UCX into the prefill node's landing area, every block of it back since
        assert clients.pushed_images == clients.remote_images and encoder.pushed > 0
        assert clients.landing is not None
        clients.landing.blocks.check_conservation()
        pushed = prefill_metrics['pdserve_prompt_images_total{source="pushed"}']
        assert pushed == clients.pushed_images
        landing_free = prefill_metrics["pdserve_embedding_landing_free_blocks"]
        assert landing_free == clients.landing.blocks.num_blocks
        assert encoder.cache.encoded_images > 0


def _chat(content: object, model: str = QWEN2_VL, **fields: object) -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        **fields,
    }


IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _parts(pictures: list[Image.Image]) -> tuple[list[dict[str, object]], str]:
    """Chat content with a text part before each picture and one after, and its rendering."""
    content: list[dict[str, object]] = []
    text = ""
    for i, picture in enumerate(pictures):
        url = {"url": _data_url(picture), **({"detail": "low"} if i else {})}
        content += [{"type": "text", "text": f"see {i} "}, {"type": "image_url", "image_url": url}]
        text += f"see {i} {IMAGE}"
    return [*content, {"type": "text", "text": " compare"}], text + " compare"


@pytest.mark.parametrize("arch", [QWEN2_VL, QWEN2_5_VL])
@pytest.mark.parametrize("split", SPLITS)
def test_chat_with_images_matches_transformers(
    checkpoints: dict[str, Path], arch: str, split: str
) -> None:
    """0, 1 and 2 images of different sizes in a chat; the same images again hit the cache."""
    checkpoint = checkpoints[arch]
    pictures = [_png(40, 24, seed=1), _png(20, 28, seed=2)]
    chats = [_parts(pictures[:n]) for n in (0, 1, 2)]
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    with single_torch_thread():
        expected = [_expected(checkpoint, text, pictures[:n]) for n, (_, text) in enumerate(chats)]

    async def body(client: httpx.AsyncClient, _: str) -> None:
        for (content, _), (ids, tokens) in zip(chats, expected, strict=True):
            request = _chat(content, model=arch)
            reply = await client.post("/v1/chat/completions", json=request)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == tokenizer.decode(tokens)
            assert reply.json()["usage"]["prompt_tokens"] == len(ids)
            counted = await client.post("/tokenize", json=request)
            assert counted.json()["tokens"] == ids
        # the same pictures again: their blocks come from the prefix cache
        again = await client.post("/v1/chat/completions", json=_chat(chats[2][0], model=arch))
        assert again.json()["choices"][0]["message"]["content"] == tokenizer.decode(expected[2][1])
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    asyncio.run(_serve(checkpoint, body, split))


def _responses_input(content: list[dict[str, object]]) -> list[dict[str, object]]:
    """Chat content parts as a Responses API user message's (input_text, input_image)."""
    parts = [
        {"type": "input_text", "text": p["text"]}
        if p["type"] == "text"
        else {"type": "input_image", "image_url": p["image_url"]["url"]}  # type: ignore[index]
        for p in content
    ]
    return [{"role": "user", "content": parts}]


def test_responses_api_with_images_matches_transformers(checkpoint: Path) -> None:
    """The official SDK's `responses.create` with input_image parts, across E/P/D: the chat
    path's answer; a follow-up turn keeps the image in its history; a file_id image is a 400."""
    content, text = _parts([_png(40, 24, seed=1)])
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    with single_torch_thread():
        ids, tokens = _expected(checkpoint, text, [_png(40, 24, seed=1)])

    async def body(client: httpx.AsyncClient, _: str) -> None:
        sdk = openai.AsyncOpenAI(base_url=f"{client.base_url}/v1", api_key="-", max_retries=0)
        kwargs = {"model": QWEN2_VL, "max_output_tokens": NEW_TOKENS, "temperature": 0.0}
        extra = {"ignore_eos": True}
        first = await sdk.responses.create(
            input=_responses_input(content), extra_body=extra, **kwargs
        )
        assert first.output_text == tokenizer.decode(tokens)
        assert first.usage is not None and first.usage.input_tokens == len(ids)
        follow = await sdk.responses.create(
            input="again", previous_response_id=first.id, extra_body=extra, **kwargs
        )
        assert follow.usage is not None and follow.usage.input_tokens > len(ids)
        # the image's blocks come from the prefix cache on the second turn
        assert follow.usage.input_tokens_details.cached_tokens > 0
        file_image = [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]
        with pytest.raises(openai.BadRequestError, match="image_url must be a string"):
            await sdk.responses.create(input=file_image, **kwargs)  # type: ignore[arg-type]
        await sdk.close()

    asyncio.run(_serve(checkpoint, body, EPD))


@pytest.mark.parametrize("split", SPLITS)
def test_grpc_generate_with_images_matches_transformers(checkpoint: Path, split: str) -> None:
    """gRPC's ImageInput (a file's bytes, a data URL): the answer's token ids are
    transformers', and so is the rest of it asked as a continuation (a stream resumed on another
    node); a prompt without its placeholder and a text-only use of images are refused."""
    pictures = [_png(24, 40, seed=4), _png(32, 16, seed=5)]
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    text = f"Look {image} and {image}"
    with single_torch_thread():
        _, expected = _expected(checkpoint, text, pictures)
    buffer = io.BytesIO()
    pictures[0].save(buffer, format="PNG")
    inputs = [
        generation_pb2.ImageInput(data=buffer.getvalue()),
        generation_pb2.ImageInput(url=_data_url(pictures[1])),
    ]
    prompt = "<|im_start|>user\n" + text + "<|im_end|>\n<|im_start|>assistant\n"
    sampling = generation_pb2.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)

    async def body(_: httpx.AsyncClient, target: str) -> None:
        async with create_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            info = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
            assert info.image_placeholder == "<|image_pad|>"  # what a client's prompt holds
            request = generation_pb2.GenerateRequest(text=prompt, sampling=sampling, images=inputs)
            got = [t async for r in stub.Generate(request, timeout=60) for t in r.token_ids]
            assert got == expected
            # what the front door asks of another node when this one dies mid-stream: the same
            # request, images included, continuing after the tokens already sent
            resumed = generation_pb2.GenerateRequest()
            resumed.CopyFrom(request)
            resumed.continuation.ids.extend(expected[:2])
            rest = [t async for r in stub.Generate(resumed, timeout=60) for t in r.token_ids]
            assert rest == expected[2:]
            short = generation_pb2.GenerateRequest(
                text="no placeholder", sampling=sampling, images=inputs[:1]
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(short, timeout=60):
                    pass
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "image placeholder" in (refused.value.details() or "")

    asyncio.run(_serve(checkpoint, body, split))


def test_encoder_down_or_refusing_falls_back_to_the_prefill_node(checkpoint: Path) -> None:
    """An encoder that is not there costs the prompt nothing but its images' local encoding;
    one that is asked for malformed images says INVALID_ARGUMENT naming the image."""
    pictures = [_png(16, 24, seed=6)]
    content = [
        {"type": "image_url", "image_url": {"url": _data_url(pictures[0])}},
        {"type": "text", "text": "?"},
    ]
    text = "<|vision_start|><|image_pad|><|vision_end|>?"
    with single_torch_thread():
        _, tokens = _expected(checkpoint, text, pictures)
    answer = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).decode(tokens)

    async def main() -> None:
        engine = EngineConfig(
            model=str(checkpoint), num_kv_blocks=64, block_size=8, dtype="float32"
        )
        dead = "127.0.0.1:1"  # nothing listens there
        config = PrefillNodeConfig(engine=engine, port=0, metrics_port=0, encoder_targets=(dead,))
        prefill = PrefillNode(config, load_model(str(checkpoint), dtype=torch.float32))
        cluster = PdCluster([prefill], [])
        await prefill.start()
        try:
            decode = await _decode_node(checkpoint, engine, cluster)
            url = f"http://127.0.0.1:{decode.http_port}"
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                reply = await client.post("/v1/chat/completions", json=_chat(content))
            assert reply.json()["choices"][0]["message"]["content"] == answer, reply.text
            assert prefill.encoders is not None and prefill.encoders.local_images == 1
            await cluster.assert_idle_and_conserved()
        finally:
            for node in [*cluster.decodes, prefill]:
                await node.stop(grace=1.0)
        encoder = EncodeNode(EncodeNodeConfig(model=str(checkpoint), dtype="float32", port=0))
        await encoder.start()
        try:
            async with create_channel(f"127.0.0.1:{encoder.port}") as channel:
                stub = encoder_pb2_grpc.EncoderStub(channel)
                bad = prefill_pb2.PromptImage(rgb=b"\0" * 10, height=8, width=8)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Encode(encoder_pb2.EncodeRequest(images=[bad]), timeout=10)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "image 1" in (refused.value.details() or "")
        finally:
            await encoder.stop(grace=1.0)

    asyncio.run(main())


def test_up_with_an_encoder_node(checkpoint: Path, tmp_path: Path) -> None:
    """`pdserve up --encode 1`: an encoder process beside the prefill and decode nodes, a
    chat with an image answered as transformers answers it, every node stopped cleanly."""
    picture = _png(24, 24, seed=7)
    content = [
        {"type": "text", "text": "A "},
        {"type": "image_url", "image_url": {"url": _data_url(picture)}},
    ]
    with single_torch_thread():
        _, tokens = _expected(
            checkpoint, "A <|vision_start|><|image_pad|><|vision_end|>", [picture]
        )
    answer = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).decode(tokens)
    up = start_up(tmp_path, "--model", str(checkpoint), "--dtype", "float32", "--encode", "1")
    try:
        assert len(up.nodes("encode")) == 1, up.tail()
        assert "1 encoder + 1 prefill + 1 decode node(s)" in "".join(up.stdout)
        reply = httpx.post(f"{up.http}/v1/chat/completions", json=_chat(content), timeout=60)
        assert reply.json()["choices"][0]["message"]["content"] == answer, reply.text
    finally:
        assert up.stop() == 0, up.tail()


def test_bad_images_are_client_errors(checkpoint: Path) -> None:
    def image(url: str) -> list[dict[str, object]]:
        return [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": url}}]

    good = _data_url(_png(16, 16, seed=3))
    truncated = good[: len(good) // 2]
    cases = {
        "bomb": (image(_bomb_url()), 400, "pixels"),
        "truncated": (image(truncated), 400, "image 1"),
        "not an image": (image("data:text/plain;base64,aGVsbG8="), 400, "image 1"),
        "remote": (image("https://example.com/cat.png"), 400, "data URL"),
        "too many": (
            [{"type": "image_url", "image_url": {"url": good}}] * 9,
            400,
            "images",
        ),
    }

    async def body(client: httpx.AsyncClient, _: str) -> None:
        for name, (content, status, words) in cases.items():
            reply = await client.post("/v1/chat/completions", json=_chat(content))
            assert reply.status_code == status, (name, reply.text)
            error = reply.json()["error"]
            assert words in error["message"] and error["param"] == "messages", (name, error)
        ok = await client.post("/v1/chat/completions", json=_chat(image(good)))
        assert ok.status_code == 200, ok.text

    asyncio.run(_serve(checkpoint, body))
