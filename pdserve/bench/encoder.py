"""TTFT of one-image prompts with the encoder role against without, same run, same load.

    pdserve bench encoder [--requests 24] [--rate 3] [--image 448] [--text 64]
                          [--vision-depth 8] [--vision-width 256] [--quick] [--out bench_out]

A random Qwen2-VL checkpoint (a vision tower of --vision-depth blocks of --vision-width, 14-pixel
patches; a small text model) is written under --out. Two clusters of separate processes serve
it in turn, as `pdserve up` starts them: P/D (1 prefill + 1 decode node; the prefill node runs
the tower) and E/P/D (1 encoder + 1 prefill + 1 decode node). Each gets the same workload:
--requests chats, each a fresh random --image x --image picture (no cache hit) and --text
characters, arriving as a Poisson process at --rate per second (a rate that keeps the prefill
node busy), streamed over gRPC with 4 output tokens; TTFT is timed at the client. Prints p50 and
p99 TTFT of both and E/P/D over P/D (below 1: the split pays on this machine), with the CPU and
its load; JSON and PNG in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import time
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

from pdserve.bench.support.load import arrival_offsets
from pdserve.bench.support.util import (
    bar_plot,
    environment,
    load_average,
    ratio,
    summarize,
    write_json,
)
from pdserve.bench.support.vl_checkpoints import QWEN2_VL, VlShape, build_vl_checkpoint
from pdserve.client import create_channel
from pdserve.cluster import Cluster
from proto.pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.serving.metrics import parse_prometheus_text

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
OUTPUT_TOKENS = 4


def _png(size: int, rng: np.random.Generator) -> bytes:
    pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _requests(a: argparse.Namespace, seed: int) -> list[generation_pb2.GenerateRequest]:
    rng = np.random.default_rng(seed)
    sampling = generation_pb2.SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    text = "<|im_start|>user\n" + "x" * a.text + IMAGE + "<|im_end|>\n<|im_start|>assistant\n"
    return [
        generation_pb2.GenerateRequest(
            text=text,
            sampling=sampling,
            images=[generation_pb2.ImageInput(data=_png(a.image, rng))],
        )
        for _ in range(a.requests)
    ]


async def _ttft(stub, request: generation_pb2.GenerateRequest, start: float) -> float:
    """Seconds from `start` (the request's send time) to its first streamed token."""
    first = None
    async for _ in stub.Generate(request, timeout=600):
        first = first or time.perf_counter()
    assert first is not None, "no token streamed"
    return first - start


async def _run_load(target: str, a: argparse.Namespace) -> list[float]:
    offsets = arrival_offsets(a.requests, a.rate, 1.0, np.random.default_rng(1))
    requests = _requests(a, seed=2)
    async with create_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await _ttft(stub, _requests(a, seed=3)[0], time.perf_counter())  # warm up both paths
        begin = time.perf_counter()

        async def one(request: generation_pb2.GenerateRequest, offset: float) -> float:
            await asyncio.sleep(max(0.0, begin + offset - time.perf_counter()))
            return await _ttft(stub, request, time.perf_counter())

        return list(await asyncio.gather(*map(one, requests, offsets)))


def _measure(model: Path, encoders: int, a: argparse.Namespace) -> tuple[list[float], float]:
    """TTFTs, and how many prompts the decode node prefilled itself (it does when its prefill
    node misses health checks: on a saturated machine the comparison is then not P/D's)."""
    extra = ["--dtype", "float32"]
    # every prompt to the prefill node; health checks far apart, as a busy one answers late
    decode = [*extra, "--local-prefill-tokens", "0", "--health-check-interval", "5"]
    cluster = Cluster(
        str(model),
        1,
        1,
        0,
        [],
        num_encode=encoders,
        encode_extra=extra,
        prefill_extra=extra,
        decode_extra=decode,
    )
    try:
        endpoints = cluster.start(echo=False)
        ttfts = asyncio.run(_run_load(endpoints[0], a))
        node = next(n for n in cluster.nodes if n.role == "decode")
        url = f"http://127.0.0.1:{node.info['metrics_port']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            metrics = parse_prometheus_text(reply.read().decode())
        return ttfts, metrics.get('pdserve_prefills_total{where="local"}', 0.0)
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench encoder", description=__doc__)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    p.add_argument("--image", type=int, default=448, help="image side in pixels")
    p.add_argument("--text", type=int, default=64, help="text characters per prompt")
    p.add_argument("--vision-depth", type=int, default=8)
    p.add_argument("--vision-width", type=int, default=256)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--quick", action="store_true", help="a 2-block tower, 6 small images")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.image, a.vision_depth, a.vision_width = 6, 112, 2, 64
    shape = VlShape(
        hidden=256,
        layers=2,
        vision_width=a.vision_width,
        vision_depth=a.vision_depth,
        vision_heads=max(1, a.vision_width // 64),
        patch=14,
        min_pixels=56 * 56,
        max_pixels=max(56 * 56, a.image * a.image),
    )
    model = build_vl_checkpoint(
        Path(a.out) / "encoder" / f"d{a.vision_depth}w{a.vision_width}", QWEN2_VL, shape=shape
    )
    load_before = load_average()
    results, local = {}, {}
    for name, encoders in (("pd", 0), ("epd", 1)):
        print(f"{name}: {a.requests} one-image chats at {a.rate}/s ...", flush=True)
        ttfts, local[name] = _measure(model, encoders, a)
        results[name] = summarize(ttfts)
    p50 = ratio(results["epd"]["p50"], results["pd"]["p50"])
    p99 = ratio(results["epd"]["p99"], results["pd"]["p99"])
    print(
        f"TTFT p50 P/D {results['pd']['p50'] * 1e3:.0f} ms, E/P/D {results['epd']['p50'] * 1e3:.0f}"
        f" ms ({p50:.2f}x); p99 {results['pd']['p99'] * 1e3:.0f} / "
        f"{results['epd']['p99'] * 1e3:.0f} ms ({p99:.2f}x); prefilled on the decode node: "
        f"{local['pd']:.0f} / {local['epd']:.0f}"
    )
    out = Path(a.out)
    payload = {"args": vars(a), "ttft_s": results, "epd_over_pd": {"p50": p50, "p99": p99}}
    payload |= {"prefilled_on_decode_node": local}
    payload |= {"load": {"start": load_before, "end": load_average()}}
    write_json(out / "encoder.json", payload | {"environment": environment()})
    bar_plot(
        out / "encoder.png",
        f"one-image chats at {a.rate}/s: TTFT",
        ["p50", "p99"],
        {name: [r["p50"] * 1e3, r["p99"] * 1e3] for name, r in results.items()},
        "ms",
    )
    return 0
