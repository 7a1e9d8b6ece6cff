"""LoRA adapters loaded and unloaded while a node serves (`--allow-runtime-lora`: vLLM's
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`): a loaded adapter is listed and
answers as transformers + peft do; bad paths, another base model's adapter, a taken name or a
full bank are 400s naming why; an adapter in use is not unloaded; an unloaded one is a 404; one
loaded again under an old name never reads the old one's cached KV; the routes sit behind
--api-key and exist only with the flag. Every seat and block is back at the end."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from pdserve.client import generate
from shared.engine.sampling.sampling_params import SamplingParams
from tests.support.checkpoints import cached_checkpoint, load_hf_model
from tests.support.lora_files import AdapterSpec, write_adapter
from tests.test_lora_engine import MAX_TOKENS, setup  # noqa: F401  (the fixture)
from tests.test_lora_http import node_with

KEY = {"Authorization": "Bearer k"}


async def _tokens(node: object, name: str, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, lora_adapter=name)
    return (await generate(f"127.0.0.1:{node.port}", prompt, params)).token_ids  # type: ignore[attr-defined]


def foreign_adapter(root: Path) -> str:
    """An adapter of a model with another hidden size: it cannot fit the base."""
    other = cached_checkpoint(root, "llama", num_hidden_layers=2, hidden_size=32)
    write_adapter(load_hf_model(other), root / "foreign", AdapterSpec(4, 8.0, ("q_proj",), 3))
    return str(root / "foreign")


def test_adapters_load_serve_and_unload_at_run_time(setup, tmp_path: Path) -> None:  # noqa: F811
    base, paths, prompts, want = setup
    long = max(range(len(prompts)), key=lambda i: len(prompts[i]))  # full blocks cached

    async def body() -> None:
        async with node_with(base, {}, 2, allow_runtime_lora=True, api_key="k") as node:
            url = f"http://127.0.0.1:{node.http_port}"
            async with httpx.AsyncClient(base_url=url, timeout=120, headers=KEY) as http:

                async def load(name: str, path: str) -> httpx.Response:
                    body = {"lora_name": name, "lora_path": path}
                    return await http.post("/v1/load_lora_adapter", json=body)

                async def unload(name: str) -> httpx.Response:
                    return await http.post("/v1/unload_lora_adapter", json={"lora_name": name})

                async def models() -> list[str]:
                    return [c["id"] for c in (await http.get("/v1/models")).json()["data"][1:]]

                assert await models() == []
                r = await load("a", paths["all-r4"])
                assert r.status_code == 200 and "added successfully" in r.text, r.text
                assert await models() == ["a"]
                assert await _tokens(node, "a", prompts[long]) == want["all-r4"][long]
                assert (await load("b", paths["qv-r8"])).status_code == 200

                for name, path, why in [
                    ("c", paths["mlp-r2"], "slots are taken"),
                    ("a", paths["mlp-r2"], "already loaded"),
                    ("d", str(tmp_path / "nowhere"), "missing"),
                    ("d", foreign_adapter(tmp_path), "does not fit the base model"),
                ]:
                    r = await load(name, path)
                    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text

                r = await http.post(
                    "/v1/load_lora_adapter",
                    json={"lora_name": "x", "lora_path": paths["qv-r8"]},
                    headers={"Authorization": "Bearer wrong"},
                )
                assert r.status_code == 401, r.text
                await _in_use_is_not_unloaded(http, node, prompts[0])

                assert (await unload("a")).status_code == 200
                assert await models() == ["b"]
                r = await http.post("/v1/completions", json={"model": "a", "prompt": "hi"})
                assert r.status_code == 404, r.text
                assert (await unload("a")).status_code == 404
                # the name again, other weights: the same prompt's cached KV is not the old one's
                assert (await load("a", paths["mlp-r2"])).status_code == 200
                assert await _tokens(node, "a", prompts[long]) == want["mlp-r2"][long]
                assert (await unload("a")).status_code == 200
                assert (await unload("b")).status_code == 200

    asyncio.run(body())


async def _in_use_is_not_unloaded(http: httpx.AsyncClient, node: object, prompt: list[int]) -> None:
    """A stream of adapter b in flight: b's unload is refused until it has ended."""
    body = {"model": "b", "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data: "):
                break  # the request is running
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 400 and "in use by 1 request" in r.text, r.text
    for _ in range(200):  # the closed stream cancels the request
        live = await node.thread.inspect(lambda core: len(core.requests))  # type: ignore[attr-defined]
        if not live:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the cancelled stream's request is still live")


def test_without_the_flag_there_are_no_update_routes(setup) -> None:  # noqa: F811
    base, paths, _, _ = setup

    async def body() -> None:
        async with node_with(base, paths) as node:
            url = f"http://127.0.0.1:{node.http_port}/v1/load_lora_adapter"
            async with httpx.AsyncClient(timeout=30) as http:
                r = await http.post(url, json={"lora_name": "z", "lora_path": paths["qv-r8"]})
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url", r.text

    asyncio.run(body())
