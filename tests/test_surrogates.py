"""A lone UTF-16 surrogate (`"\\ud800"`: valid JSON, not Unicode text) in any string of a
request is a 400 naming its field on every HTTP endpoint (it used to reach the tokenizer: a 500
with a TypeError); on gRPC it cannot be sent by a conforming client (protobuf refuses to encode
it) and its byte form (CESU-8, what a lax encoder writes) is INVALID_ARGUMENT. After each case
the node holds nothing and still serves correct greedy output."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from proto.pdserve.v1 import generation_pb2
from tests.fuzz_loop import LiveHttp

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
LONE = "a\ud800b"


@pytest.fixture(scope="module")
def api(checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveHttp]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    node = LiveHttp(checkpoint("llama"), chat_template=str(template))
    yield node
    node.close()


def _cases(model: str) -> list[tuple[str, dict[str, Any], str]]:
    """(path, body, the field the 400 must name)."""
    chat = {"model": model, "max_tokens": 2}
    done = {"model": model, "max_tokens": 2, "prompt": "Hello"}
    user = {"role": "user", "content": "hi"}
    parts = {"role": "user", "content": [{"type": "text", "text": LONE}]}
    return [
        ("/v1/completions", {**done, "prompt": LONE}, "prompt"),
        ("/v1/completions", {**done, "prompt": ["fine", LONE]}, "prompt.1"),
        ("/v1/completions", {**done, "prompt": LONE, "stream": True}, "prompt"),
        ("/v1/completions", {**done, "stop": ["ok", LONE]}, "stop.1"),
        ("/v1/completions", {**done, "stop": LONE, "stream": True}, "stop"),
        ("/v1/completions", {**done, "model": LONE}, "model"),
        (
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": LONE}]},
            "messages.0.content",
        ),
        ("/v1/chat/completions", {**chat, "messages": [user, parts]}, "messages.1.content.0.text"),
        (
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": LONE}], "stream": True},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {**chat, "messages": [user], "chat_template_kwargs": {"x": LONE}},
            "chat_template_kwargs.x",
        ),
        ("/v1/chat/completions", {**chat, "messages": [user], "user": "\udfff"}, "user"),
        ("/tokenize", {"model": model, "prompt": LONE}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ]


def test_lone_surrogates_are_400_naming_the_field_on_every_endpoint(api: LiveHttp) -> None:
    for path, body, field in _cases(api.model):
        resp = api.post(path, body)
        assert resp.status_code == 400, (path, body, resp.text)
        error = resp.json()["error"]
        assert error["param"] == field, (path, error)
        assert "lone surrogate" in error["message"] and field in error["message"], error
        assert error["type"] == "invalid_request_error"
    api.runner.run(api.still_serving())


def test_a_surrogate_pair_is_text_and_is_served(api: LiveHttp) -> None:
    body = {"model": api.model, "prompt": "smile \ud83d\ude00", "max_tokens": 2}  # U+1F600
    resp = api.post("/v1/completions", body)
    assert resp.status_code == 200, resp.text
    resp = api.post("/tokenize", {"prompt": "\ud83d\ude00", "add_special_tokens": False})
    assert resp.status_code == 200 and resp.json()["count"] >= 1, resp.text
    api.runner.run(api.still_serving())


def test_grpc_a_surrogate_cannot_be_sent_and_its_bytes_are_invalid_argument(
    api: LiveHttp,
) -> None:
    with pytest.raises(UnicodeEncodeError):
        generation_pb2.GenerateRequest(text=LONE).SerializeToString()
    cesu = LONE.encode("utf-8", "surrogatepass")  # b"a\xed\xa0\x80b"
    stop = generation_pb2.SamplingParams(max_tokens=2).SerializeToString()
    for field, raw in ((b"\x12", cesu), (b"\x0a", cesu)):  # text (2), request_id (1)
        data = field + bytes([len(raw)]) + raw + b"\x22" + bytes([len(stop)]) + stop
        code, details = api.runner.run(_call(api, data))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    inner = stop + b"\x32" + bytes([len(cesu)]) + cesu  # sampling.stop (6)
    data = b"\x12\x02hi\x22" + bytes([len(inner)]) + inner
    code, details = api.runner.run(_call(api, data))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    api.runner.run(api.still_serving())


async def _call(api: LiveHttp, data: bytes) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(api.cluster.targets[0]) as channel:
        call = channel.unary_stream("/pdserve.v1.Generation/Generate")(data, timeout=30)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""
