"""The hardware ceilings a roofline is drawn against: bare GEMMs of the model's own projection
shapes, and memory read bandwidth."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.bench.roofline_models import linear_shapes
from shared.model import panel_gemm
from shared.model.config import ModelConfig
from shared.model.gemm import onednn_bf16_available, onednn_linear, pack_onednn


def best_time(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def onednn_usable(dtype: torch.dtype) -> bool:
    """oneDNN's packed GEMM takes bf16 only where the CPU has AVX-512 (or AVX-NE-CONVERT)."""
    if dtype == torch.bfloat16:
        return onednn_bf16_available()
    return torch.backends.mkldnn.is_available()


def matmul_ceiling(c: ModelConfig, dtype: torch.dtype, tokens: int, reps: int) -> dict[str, Any]:
    """Bare GEMM GFLOP/s for each of the model's GEMM shapes at `tokens` rows, the fastest of
    `F.linear` (MKL in fp32), oneDNN on a pre-packed weight (MKL runs a slow path on AMD) and,
    where the engine runs it, the panel kernel on its packed weight; and the aggregate a layer
    would reach if every GEMM ran at its bare speed."""
    gen = torch.Generator().manual_seed(0)
    shapes, flops_total, time_total = [], 0.0, 0.0
    for n_in, n_out in linear_shapes(c):
        x = torch.randn(tokens, n_in, generator=gen).to(dtype)
        w = (torch.randn(n_out, n_in, generator=gen) * 0.02).to(dtype)
        seconds = best_time(lambda x=x, w=w: F.linear(x, w), reps)
        if onednn_usable(dtype):
            packed = pack_onednn(w)
            seconds = min(seconds, best_time(partial(onednn_linear, x, packed), reps))
        if panel_gemm.usable(w):
            panel = panel_gemm.pack(w)
            run = partial(panel_gemm.linear, x, panel, None, n_out)
            seconds = min(seconds, best_time(run, reps))
        flops = 2.0 * tokens * n_in * n_out
        shapes.append({"in": n_in, "out": n_out, "gflops": flops / seconds / 1e9})
        flops_total += flops
        time_total += seconds
    return {"tokens": tokens, "gflops": flops_total / time_total / 1e9, "shapes": shapes}


def bandwidth(num_bytes: int, reps: int) -> dict[str, float]:
    """Memory read bandwidth (sum of a large fp32 tensor) and copy bandwidth (read + write)."""
    x = torch.ones(num_bytes // 4)
    y = torch.empty_like(x)
    read = best_time(x.sum, reps)
    copy = best_time(lambda: y.copy_(x), reps)
    return {
        "bytes": float(num_bytes),
        "read_gbps": num_bytes / read / 1e9,
        "copy_gbps": 2 * num_bytes / copy / 1e9,
    }
