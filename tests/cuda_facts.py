"""Facts the CUDA tests measure and report (not assert): which UCX transport moved KV, bf16
agreement with transformers. scripts/gpu-check sets PDSERVE_GPU_FACTS to a JSON-lines file and
prints them in its summary; elsewhere `record` does nothing."""

from __future__ import annotations

import json
import os

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA_MARKS = [pytest.mark.cuda, requires_cuda]


def record(key: str, value: object) -> None:
    path = os.environ.get("PDSERVE_GPU_FACTS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "value": value}) + "\n")
