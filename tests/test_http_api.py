"""The HTTP API on the raw wire (httpx) against an in-process P/D cluster (real uvicorn, gRPC and
UCX): SSE framing byte for byte, every error status, disconnects before and after the first
token, 200 concurrent streams. After each test every seat and block is back on both nodes."""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from shared.serving.tls import ServerTls
from tests.support.cluster import PdCluster, pd_cluster

MODEL = "tiny"
_EVENT = re.compile(rb"data: ([^\n]*)\n\n")


@pytest.fixture
def run():
    """Run `body(cluster, client)` against a fresh 1 prefill + 1 decode cluster."""

    def runner(body, **decode_overrides):
        async def main() -> None:
            overrides = {"http_port": 0, **decode_overrides}
            async with pd_cluster(MODEL, decode_overrides=overrides) as cluster:
                url = f"http://127.0.0.1:{cluster.decodes[0].http_port}"
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    await body(cluster, client)
                    await cluster.assert_idle_and_conserved()
                    # the node keeps serving after whatever the test threw at it
                    name = cluster.decodes[0].config.served_model_name or MODEL
                    final = _completion(model=name, max_tokens=2)
                    ok = await client.post("/v1/completions", json=final)
                    assert ok.status_code == 200, ok.text
                await cluster.assert_idle_and_conserved()

        asyncio.run(main())

    return runner


def _completion(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": "Hello there", "temperature": 0.0, **fields}


def _events(raw: bytes) -> list[bytes]:
    """Split an SSE body, asserting it is exactly a sequence of `data: ...\\n\\n` events."""
    events = [m.group(1) for m in _EVENT.finditer(raw)]
    assert b"".join(b"data: " + e + b"\n\n" for e in events) == raw, raw[:300]
    return events


def _error(resp: httpx.Response, status: int) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_sse_framing_on_the_raw_bytes(run) -> None:
    async def body(cluster: PdCluster, client: httpx.AsyncClient) -> None:
        # completions, no usage asked: no usage anywhere
        resp = await client.post("/v1/completions", json=_completion(max_tokens=6, stream=True))
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = _events(resp.content)
        assert events[-1] == b"[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
        assert len({c["id"] for c in chunks}) == 1
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        texts = "".join(c["choices"][0]["text"] for c in chunks)
        whole = await client.post("/v1/completions", json=_completion(max_tokens=6))
        assert whole.json()["choices"][0]["text"] == texts  # greedy: the same text

        # chat-shaped chunks need a template; completions with usage: exactly one usage chunk
        options = {"include_usage": True}
        resp = await client.post(
            "/v1/completions",
            json=_completion(max_tokens=5, stream=True, stream_options=options),
        )
        chunks = [json.loads(e) for e in _events(resp.content)[:-1]]
        with_usage = [c for c in chunks if "usage" in c]
        assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
        assert chunks[-1]["choices"] == []
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 5
        assert usage["total_tokens"] == usage["prompt_tokens"] + 5
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0

        # continuous usage: every chunk with choices carries the running count
        options = {"include_usage": True, "continuous_usage_stats": True}
        resp = await client.post(
            "/v1/completions",
            json=_completion(max_tokens=4, stream=True, stream_options=options),
        )
        chunks = [json.loads(e) for e in _events(resp.content)[:-1]]
        counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
        assert counts == sorted(counts) and counts[-1] == 4

        # a batch: each prompt its own request, choices indexed
        resp = await client.post(
            "/v1/completions",
            json=_completion(prompt=[[5, 6, 7], [8, 9]], max_tokens=3, stream=True),
        )
        chunks = [json.loads(e) for e in _events(resp.content)[:-1]]
        finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert sorted(finished) == [0, 1]

    run(body)


def test_bad_requests_get_their_status_and_name_the_field(run) -> None:
    async def body(cluster: PdCluster, client: httpx.AsyncClient) -> None:
        post = client.post
        headers = {"content-type": "application/json"}
        error = _error(await post("/v1/completions", content=b"{nope", headers=headers), 400)
        assert "JSON" in error["message"]
        _error(await post("/v1/completions", content=b"", headers=headers), 400)
        _error(await post("/v1/completions", content=b"[1, 2]", headers=headers), 400)
        error = _error(await post("/v1/completions", json=_completion(max_tokens="9")), 400)
        assert error["param"] == "max_tokens"
        error = _error(await post("/v1/completions", json=_completion(temperature="hot")), 400)
        assert error["param"] == "temperature"
        error = _error(await post("/v1/completions", json=_completion(prompt={"a": 1})), 400)
        assert error["param"] == "prompt"
        error = _error(await post("/v1/completions", json=_completion(max_tokens=10**9)), 400)
        assert error["param"] == "max_tokens" and "context" in error["message"]
        error = _error(await post("/v1/completions", json=_completion(top_p=0.0)), 400)
        assert error["param"] == "top_p"
        error = _error(await post("/v1/completions", json=_completion(prompt=[10**6])), 400)
        assert error["param"] == "prompt"
        error = _error(await post("/v1/completions", json=_completion(best_of=2, suffix="x")), 400)
        assert "best_of" in error["message"] and "suffix" in error["message"]
        error = _error(await post("/v1/completions", json=_completion(model="gpt-4")), 404)
        assert error["param"] == "model" and error["code"] == "model_not_found"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        error = _error(await post("/v1/chat/completions", json=chat), 400)
        assert "chat template" in error["message"]
        _error(await client.get("/v1/nothing"), 404)
        _error(await client.get("/v1/completions"), 405)
        # unknown fields are ignored, no-op values of unsupported ones pass
        ok = await post("/v1/completions", json=_completion(max_tokens=2, n=1, whatever=3))
        assert ok.status_code == 200, ok.text

    run(body)


def test_oversized_body_is_refused_before_parsing(run) -> None:
    async def body(cluster: PdCluster, client: httpx.AsyncClient) -> None:
        huge = b'{"model": "tiny", "prompt": "' + b"a" * (100 * 1024 * 1024) + b'"}'
        resp = await client.post(
            "/v1/completions", content=huge, headers={"content-type": "application/json"}
        )
        assert _error(resp, 413)["code"] == "request_too_large"

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
            for _ in range(40):
                yield b" " * (1024 * 1024)

        resp = await client.post("/v1/completions", content=chunked())
        _error(resp, 413)

    run(body, max_request_bytes=8 * 1024 * 1024)


def test_api_key_is_required_on_the_api_only(run) -> None:
    async def body(cluster: PdCluster, client: httpx.AsyncClient) -> None:
        _error(await client.get("/v1/models"), 401)
        wrong = {"authorization": "Bearer nope"}
        _error(await client.post("/v1/completions", json=_completion(), headers=wrong), 401)
        _error(await client.post("/v1/completions", content=b"{", headers=wrong), 401)
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        client.headers["authorization"] = "Bearer s3cret"
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "tiny-served"
        assert models["data"][0]["max_model_len"] > 0 and models["data"][0]["root"] == MODEL
        _error(await client.post("/v1/completions", json=_completion(model=MODEL)), 404)
        version = (await client.get("/version")).json()
        assert version["version"]
        kernels = version["kernels"].values()  # each C kernel: on, or off and why
        assert all((k["state"] == "on" and k["path"]) or k["reason"] for k in kernels)
        # attention's path per kind, timed at the nodes' start (or cached), and its times
        attention = version["attention"]
        assert set(attention["paths"]) == {"prefill", "decode"}
        assert attention["source"] in ("measured", "cache", "PDSERVE_ATTENTION")

    run(body, api_key="s3cret", served_model_name="tiny-served")


async def _wait_for_streams(cluster: PdCluster, n: int) -> None:
    deadline = time.monotonic() + 30
    while len(cluster.decodes[0].streams) != n:
        assert time.monotonic() < deadline, f"{len(cluster.decodes[0].streams)} streams, not {n}"
        await asyncio.sleep(0.01)


def test_disconnect_mid_stream_aborts_on_both_nodes(run) -> None:
    async def body(cluster: PdCluster, client: httpx.AsyncClient) -> None:
        long = _completion(max_tokens=3000, ignore_eos=True, stream=True)
        for _ in range(3):
            async with client.stream("POST", "/v1/completions", json=long) as resp:
                assert resp.status_code == 200
                seen = 0
                async for _line in resp.aiter_lines():
                    seen += 1
                    if seen >= 6:
                        break  # leaving the block closes the connection mid-stream
            await _wait_for_streams(cluster, 0)
        # the non-streaming form: the client gives up while the answer is being generated
        with pytest.raises(httpx.ReadTimeout):
            await client.post(
                "/v1/completions", json={**long, "stream": False}, timeout=httpx.Timeout(0.5)
            )
        await _wait_for_streams(cluster, 0)

    run(body)


def test_disconnect_before_first_token_and_timeout(run) -> None:
    """A prefill node busy for a while: the client leaves (or its timeout passes) before the
    first token; the request is withdrawn from both nodes."""

    async def body(cluster: PdCluster, client: httpx.AsyncClient) -> None:
        prefill = cluster.prefills[0]
        for stream in (True, False):
            busy = asyncio.ensure_future(prefill.thread.inspect(lambda core: time.sleep(1.5)))
            await asyncio.sleep(0.05)
            with pytest.raises(httpx.ReadTimeout):
                await client.post(
                    "/v1/completions",
                    json=_completion(max_tokens=50, stream=stream),
                    timeout=httpx.Timeout(0.4),
                )
            await _wait_for_streams(cluster, 0)
            await busy
        busy = asyncio.ensure_future(prefill.thread.inspect(lambda core: time.sleep(1.5)))
        await asyncio.sleep(0.05)
        resp = await client.post(
            "/v1/completions", json=_completion(stream=True), headers={"x-request-timeout": "0.3"}
        )
        assert _error(resp, 504)["code"] == "timeout"
        _error(
            await client.post(
                "/v1/completions", json=_completion(), headers={"x-request-timeout": "soon"}
            ),
            400,
        )
        await busy
        # the deadline passes mid-stream: a final SSE error event, then [DONE]
        long = _completion(max_tokens=3000, ignore_eos=True, stream=True)
        resp = await client.post("/v1/completions", json=long, headers={"x-request-timeout": "0.5"})
        events = _events(resp.content)
        assert resp.status_code == 200 and events[-1] == b"[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "timeout"
        assert all(json.loads(e)["object"] == "text_completion" for e in events[:-2])

    run(body)


def test_200_concurrent_streams(run) -> None:
    async def body(cluster: PdCluster, client: httpx.AsyncClient) -> None:
        limits = httpx.Limits(max_connections=250)
        wide = httpx.AsyncClient(base_url=client.base_url, timeout=300, limits=limits)

        async def one(i: int) -> tuple[str, int]:
            prompt = [1 + i % 200, 2, 3]
            req = _completion(prompt=prompt, max_tokens=4, ignore_eos=True, stream=True)
            resp = await wide.post("/v1/completions", json=req)
            events = _events(resp.content)
            assert events[-1] == b"[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            return chunks[-1]["choices"][0]["finish_reason"], len(chunks)

        async with wide:
            results = await asyncio.gather(*(one(i) for i in range(200)))
        assert [reason for reason, _ in results] == ["length"] * 200

    run(body)


def test_tls_with_the_grpc_options(tmp_path: Path) -> None:
    from tests.test_tls import make_pki

    pki = make_pki(tmp_path)

    async def main() -> None:
        tls = ServerTls(pki["server.pem"], pki["server.key"])
        async with pd_cluster(MODEL, decode_overrides={"http_port": 0, "tls": tls}) as cluster:
            decode = cluster.decodes[0]
            assert decode.http is not None and decode.http.scheme == "https"
            verify = ssl.create_default_context(cafile=pki["ca.pem"])
            async with httpx.AsyncClient(base_url=decode.http.url, verify=verify) as client:
                resp = await client.post("/v1/completions", json=_completion(max_tokens=3))
                assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
            plain = f"http://127.0.0.1:{decode.http_port}"
            async with httpx.AsyncClient(base_url=plain) as client:
                with pytest.raises(httpx.HTTPError):
                    await client.get("/v1/models")
            await cluster.assert_idle_and_conserved()

    asyncio.run(main())


def test_no_healthy_prefill_node_is_503_with_retry_after(run) -> None:
    async def body(cluster: PdCluster, client: httpx.AsyncClient) -> None:
        decode = cluster.decodes[0]
        for peer in decode.pool.replicas:
            decode.pool.mark_unhealthy(peer, "test: as after failed health checks")
        health = await client.get("/health")
        assert health.status_code == 503 and health.headers["retry-after"]
        resp = await client.post("/v1/completions", json=_completion(max_tokens=2))
        assert _error(resp, 503)["code"] == "unavailable"
        assert resp.headers["retry-after"] == "1"
        deadline = time.monotonic() + 30  # the next health round finds the node alive again
        while (await client.get("/health")).status_code != 200:
            assert time.monotonic() < deadline, "the prefill node never came back"
            await asyncio.sleep(0.1)

    run(body)


def test_chat_with_a_template_file_and_content_parts(run, tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )

    async def body(cluster: PdCluster, client: httpx.AsyncClient) -> None:
        def chat(content: object, **fields: object) -> dict[str, object]:
            messages = [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": content},
            ]
            return {"model": MODEL, "messages": messages, "temperature": 0, **fields}

        plain = await client.post("/v1/chat/completions", json=chat("a\nb", max_tokens=4))
        parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        split = await client.post("/v1/chat/completions", json=chat(parts, max_tokens=4))
        assert plain.status_code == 200 and split.status_code == 200, split.text
        assert plain.json()["object"] == "chat.completion"
        assert plain.json()["choices"][0]["message"] == split.json()["choices"][0]["message"]
        rendered = "[system] be brief\n[user] a\nb\n[assistant] "
        tok = cluster.decodes[0].core.tokenizer
        want = len(tok.encode(rendered, add_special_tokens=False))
        assert plain.json()["usage"]["prompt_tokens"] == want
        image = [{"type": "image_url", "image_url": {"url": "x"}}]
        # a text model refuses images rather than dropping them
        error = _error(await client.post("/v1/chat/completions", json=chat(image)), 400)
        assert error["param"] == "messages" and "takes text only" in error["message"]
        bad_role = {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}
        error = _error(await client.post("/v1/chat/completions", json=bad_role), 400)
        assert error["param"] == "messages.0.role"
        empty = {"model": MODEL, "messages": []}
        _error(await client.post("/v1/chat/completions", json=empty), 400)
        stream = await client.post(
            "/v1/chat/completions", json=chat("hi", max_tokens=3, stream=True)
        )
        chunks = [json.loads(e) for e in _events(stream.content)[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    run(body, chat_template=str(template))
