"""With no sizing flag a node serves the context it advertises: the KV pool sized from the memory
free after the weights load, a prompt of `max_model_len - 32` tokens with max_tokens 24 gives
transformers' greedy tokens exactly, on a colocated node and through P/D. The sizing reads only
the KV bytes per token, so a small fp32 Llama with SmolLM2's 8,192-token context stands in for a
real model: three whole-context prefills take seconds instead of minutes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.engine.config import EngineConfig
from shared.engine.sampling.sampling_params import SamplingParams
from tests.engine_helpers import hf_greedy, random_prompts, single_torch_thread
from tests.sampling_reference import pd_generate
from tests.support.cluster import pd_cluster

CONTEXT = 8192  # SmolLM2's
VOCAB = 512  # the small checkpoints' (tests/support/checkpoints.py)
# an 8k-token prefill on a loaded two-core machine may outlast the default 30 s / 60 s
SLOW_MACHINE = {"http_port": 0, "kv_transfer_timeout": 120.0, "prefill_timeout": 120.0}


@pytest.fixture(autouse=True)
def _one_thread():
    with single_torch_thread():
        yield


@pytest.fixture(scope="module")
def model(checkpoint: Callable[..., Path]) -> Path:
    return checkpoint("llama", max_position_embeddings=CONTEXT)


async def _serve(
    model: Path, colocated: bool, prompt_for: Any
) -> tuple[int, list[int], dict[str, Any]]:
    """(the advertised max_model_len, the tokens, /version's kv_pool) from a fresh cluster."""
    engine = EngineConfig(model=str(model), dtype="float32")  # no --kv-cache-mb, --num-kv-blocks
    async with pd_cluster(
        str(model),
        colocated=colocated,
        prefill_engine=engine,
        decode_engine=engine,
        decode_overrides=SLOW_MACHINE,
    ) as c:
        node = c.decodes[0]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{node.http_port}") as http:
            max_len = (await http.get("/v1/models")).json()["data"][0]["max_model_len"]
            pool = (await http.get("/version")).json()["kv_pool"]
        params = SamplingParams(max_tokens=24)
        got = await pd_generate(c.targets[0], prompt_for(max_len), params, timeout=120)
        return max_len, got[0].token_ids, pool


def test_memory_sized_pool_serves_max_model_len_minus_32_exactly(model: Path) -> None:
    prompts: dict[int, list[int]] = {}

    def prompt_for(max_len: int) -> list[int]:
        length = max_len - 32
        return prompts.setdefault(
            length, random_prompts(1, VOCAB, seed=62, min_len=length, max_len=length)[0]
        )

    colocated = asyncio.run(_serve(model, True, prompt_for))
    pd = asyncio.run(_serve(model, False, prompt_for))
    max_len, _, pool = colocated
    assert pool["sized_by"].startswith("--kv-cache-memory-fraction 0.1 of "), pool
    # the whole 8,192-token context where 0.1 of the free memory holds it
    assert max_len == pool["max_model_len"] == min(CONTEXT, pool["tokens"] + 1), pool
    assert pd[0] == max_len, (pd, max_len)
    prompt = prompts[max_len - 32]
    want = hf_greedy(model, prompt, 24)
    assert colocated[1] == want, (colocated[1], want)
    assert pd[1] == want, (pd[1], want)
