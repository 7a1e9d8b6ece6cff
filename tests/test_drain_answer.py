"""Requests still running when a node's drain grace ends are answered 503 with OpenAI's error
object (a stream: an error event, then [DONE]), never uvicorn's plain-text 500 or a stream cut
without its end; the node still returns every seat and block. A real node, uvicorn, httpx."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from decode_node.config import DecodeNodeConfig
from shared.engine.config import EngineConfig
from shared.model.loader import load_model
from tests.engine_helpers import single_torch_thread

ENGINE = EngineConfig(model="tiny", num_kv_blocks=1024, max_batch_size=4)
LONG = {"model": "tiny", "prompt": "drain me", "max_tokens": 4000, "ignore_eos": True}


@pytest.fixture(autouse=True)
def _one_thread():
    with single_torch_thread():
        yield


async def _stream_events(http: httpx.AsyncClient, first: asyncio.Event) -> list[str]:
    events = []
    async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                first.set()
    return events


def test_requests_cut_by_the_drain_get_503_and_an_error_event() -> None:
    from decode_node.server import DecodeNode

    async def body() -> None:
        cfg = DecodeNodeConfig(engine=ENGINE, colocated=True, port=0, metrics_port=0, http_port=0)
        node = DecodeNode(cfg, load_model("tiny"))
        await node.start()
        url = f"http://127.0.0.1:{node.http_port}"
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            whole = asyncio.create_task(http.post("/v1/completions", json=LONG))
            first = asyncio.Event()
            streamed = asyncio.create_task(_stream_events(http, first))
            await asyncio.wait_for(first.wait(), 30)
            while len(node.streams) < 2:
                await asyncio.sleep(0.01)
            assert await node.stop(grace=0.3), "seats or blocks leaked"
            r = await whole
            events = await streamed
        assert r.status_code == 503, r.text
        assert r.headers["content-type"] == "application/json" and "retry-after" in r.headers
        error = r.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "shutdown", error
        assert "drain grace ended" in error["message"], error
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert last["error"]["type"] == "service_unavailable", last
        assert "drain grace ended" in last["error"]["message"], last
        assert all("choices" in json.loads(e) for e in events[:-2])  # tokens came before it

    asyncio.run(body())
