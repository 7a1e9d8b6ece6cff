"""LoRA adapters over the OpenAI API of a node: `/v1/models` lists the base and each adapter
(`parent` = the base), a completion whose `model` names an adapter is generated with it (the
same text as gRPC's `lora_adapter`, whose tokens equal transformers + peft), and an unknown model
is a 404 naming it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

from decode_node.config import DecodeNodeConfig
from pdserve.client import generate
from shared.engine.config import EngineConfig
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.test_lora_engine import MAX_TOKENS, setup  # noqa: F401  (the fixture)


@contextlib.asynccontextmanager
async def node_with(
    base, paths: dict[str, str], max_loras: int = 0, **node: object
) -> AsyncIterator[object]:
    """A colocated node serving `paths` (NAME -> PATH) in `max_loras` slots (0: as many)."""
    from decode_node.server import DecodeNode

    engine = EngineConfig(
        model=str(base),
        num_kv_blocks=256,
        lora_modules=tuple(paths.items()),
        max_loras=max_loras,
        max_lora_rank=8,
    )
    cfg = DecodeNodeConfig(
        engine=engine, colocated=True, port=0, metrics_port=0, http_port=0, **node
    )
    node = DecodeNode(cfg, load_model(str(base)))
    await node.start()
    try:
        yield node
    finally:
        assert await node.stop(grace=1.0), "seats or blocks leaked"


def test_models_list_and_completions_by_adapter(setup) -> None:  # noqa: F811
    base, paths, prompts, want = setup

    async def body() -> None:
        async with node_with(base, paths) as node:
            url = f"http://127.0.0.1:{node.http_port}"
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                cards = (await http.get("/v1/models")).json()["data"]
                root = cards[0]["id"]
                assert cards[0]["parent"] is None
                assert [(c["id"], c["parent"]) for c in cards[1:]] == [
                    (name, root) for name in sorted(paths)
                ]
                for name in sorted(paths):
                    body = {"model": name, "prompt": prompts[1], "max_tokens": MAX_TOKENS}
                    body |= {"temperature": 0, "ignore_eos": True}
                    r = await http.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    params = SamplingParams(
                        max_tokens=MAX_TOKENS, ignore_eos=True, lora_adapter=name
                    )
                    grpc_result = await generate(f"127.0.0.1:{node.port}", prompts[1], params)
                    assert grpc_result.token_ids == want[name][1], name
                    assert r.json()["choices"][0]["text"] == grpc_result.text, name
                r = await http.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
                assert r.status_code == 404, r.text
                error = r.json()["error"]
                assert "`nope` does not exist" in error["message"], error
                assert "all-r4" in error["message"] and error["param"] == "model", error

    asyncio.run(body())
