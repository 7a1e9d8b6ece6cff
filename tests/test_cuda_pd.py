"""P/D on one GPU: a prefill and a decode process share it, KV moves device pool to device pool
(UCX cuda_copy / cuda_ipc, or the staging path: whichever UCX picks is reported), greedy and
seeded sampling are identical to the colocated engine on the same GPU, everything is released."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.client import generate
from pdserve.cluster import Cluster
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from shared.serving.metrics import parse_prometheus_text
from tests.cuda_facts import CUDA_MARKS, record
from tests.engine_helpers import random_max_tokens, random_prompts

pytestmark = CUDA_MARKS
ENGINE = ["--device", "cuda", "--dtype", "float32", "--num-kv-blocks", "512"]
TRANSPORTS = ("cuda_ipc", "cuda_copy", "gdr_copy", "sysv", "posix", "cma", "tcp", "self")


def node_metrics(cluster: Cluster) -> list[dict[str, float]]:
    out = []
    for node in cluster.nodes:
        url = f"http://127.0.0.1:{node.info['metrics_port']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            out.append(parse_prometheus_text(resp.read().decode()))
    return out


def transports_seen(texts: list[str]) -> dict[str, int]:
    """Transports named in UCX's protocol-selection lines (UCX_PROTO_INFO=y) for messages
    from or to CUDA memory, counted over the nodes' UCX logs and output."""
    seen: dict[str, int] = {}
    for text in texts:
        cuda_section = False
        for line in text.splitlines():
            if "from cuda" in line or "to cuda" in line or "cuda/GPU" in line:
                cuda_section = True
            elif re.search(r"from host|to host", line):
                cuda_section = False
            if cuda_section:
                for name in TRANSPORTS:
                    if re.search(rf"\b{name}\b", line):
                        seen[name] = seen.get(name, 0) + 1
    return seen


def test_pd_on_one_gpu_matches_colocated(
    checkpoint: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    path = checkpoint("llama")
    prompts = random_prompts(8, 512, min_len=16, max_len=300, seed=90)
    max_tokens = random_max_tokens(8, lo=4, hi=24, seed=91)
    seeded = [i % 2 == 1 for i in range(8)]  # odd requests sample (temperature 0.8, seed i)
    params = [
        SamplingParams(max_tokens=m, temperature=0.8 if s else 0.0, seed=i)
        for i, (m, s) in enumerate(zip(max_tokens, seeded, strict=True))
    ]
    config = EngineConfig(model=str(path), num_kv_blocks=512, device="cuda", dtype="float32")
    colocated = LLM(config, load_model(str(path), torch.device("cuda"), torch.float32))
    want = [o.token_ids for o in colocated.generate(prompts, params)]
    colocated.core.check_conservation()
    del colocated

    monkeypatch.setenv("UCX_PROTO_INFO", "y")
    monkeypatch.setenv("UCX_LOG_FILE", str(tmp_path / "ucx.%h.%p.log"))
    # every prompt prefilled on the prefill node: a decode node left to its defaults prefills
    # prompts this short itself (local prefill), and no KV would cross the GPU
    local_off = ["--local-prefill-tokens", "0", "--local-prefill-idle-tokens", "0"]
    cluster = Cluster(str(path), 1, 1, 0, ENGINE, decode_extra=local_off)
    try:
        (target,) = cluster.start(timeout=180, echo=True)  # echoed: UCX may print to stdout

        async def body() -> list[object]:
            # one at a time: the colocated run batched them, the sampler's streams do not care
            out = []
            for p, sp in zip(prompts, params, strict=True):
                kwargs = {"temperature": sp.temperature, "seed": sp.seed, "timeout": 120}
                out.append(await generate(target, p, max_tokens=sp.max_tokens, **kwargs))
            return out

        results = asyncio.run(body())
        for i, r in enumerate(results):
            kind = "seeded sampling" if seeded[i] else "greedy"
            assert r.token_ids == want[i], f"request {i} ({kind}) differs from colocated"
        pushed = sum(m.get("pdserve_kv_transfer_bytes_total", 0) for m in node_metrics(cluster))
        assert pushed > 0
        deadline = time.monotonic() + 10
        held = ("pdserve_seats_in_use", "pdserve_kv_blocks_pinned")
        while any(m[k] for m in node_metrics(cluster) for k in held):
            assert time.monotonic() < deadline, "resources still held after the requests"
            time.sleep(0.1)
    finally:
        assert cluster.stop() == 0, "a node exited non-zero (conservation at shutdown?)"
    logs = [p.read_text(errors="replace") for p in tmp_path.glob("ucx.*")]
    seen = transports_seen([*logs, capfd.readouterr().err])  # the nodes' stdout, echoed
    record("UCX transports for CUDA memory (protocol lines)", seen or "none reported")
    record("KV bytes pushed", int(pushed))
