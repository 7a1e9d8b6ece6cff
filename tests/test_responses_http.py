"""OpenAI's Responses API through the official `openai` SDK, on a colocated node serving the
tiny model with a tool-aware (Qwen-style) chat template and no --tool-call-parser: plain and
streamed answers agree, the SDK's stream accumulator rebuilds the same response, a function-tool
round trip by previous_response_id renders exactly the prompt the same turns given as items do,
"auto" reads the template's own call format, text.format json_schema fits its schema,
retrieve/delete/store:false/another credential, refusals name their field, and an unserved route
is OpenAI's 404 naming it. Then through the proxy, with two replicas: a stored response is
found on the replica that made it. pydantic-ai's OpenAIResponsesModel (when installed): text,
a tool-call output (tool_choice required) and a native json_schema output, whole and streamed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.engine_helpers import single_torch_thread
from tests.support.cluster import pd_cluster
from tests.test_tools import QWEN_TOOLS
from tests.tool_corpus import SCHEMAS

ADD = {
    "type": "function",
    "name": "add",
    "description": "add two numbers",
    "parameters": SCHEMAS["add"],
}
ADD_CALL = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}\n</tool_call>'
LONG = {"ignore_eos": True}  # the tiny model may end at once: exact lengths need EOS ignored


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    legs: int = pydantic.Field(ge=0, le=4)


async def plain_and_streamed(client: openai.AsyncOpenAI, model: str) -> None:
    """Greedy: the whole answer, the raw events and the SDK's accumulated stream agree."""
    kwargs: dict[str, Any] = {
        "model": model,
        "input": "Say hello.",
        "instructions": "You are terse.",
        "max_output_tokens": 6,
        "temperature": 0.0,
        "extra_body": LONG,
    }
    whole = await client.responses.create(**kwargs)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 6 and whole.output_text, whole
    assert [item.type for item in whole.output] == ["message"]
    bare = await client.responses.create(**{**kwargs, "instructions": None})
    assert bare.usage.input_tokens < whole.usage.input_tokens  # the instructions were rendered
    events = [e async for e in await client.responses.create(**kwargs, stream=True)]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    async with client.responses.stream(**kwargs) as stream:  # the SDK's accumulator
        last = [e async for e in stream][-1]
    assert last.type == "response.incomplete" and last.response.output_text == whole.output_text


async def tool_round_trip(client: openai.AsyncOpenAI, model: str) -> None:
    """A named tool's call -> its output by previous_response_id -> an answer; the same turns
    given as items render the very same prompt (equal input tokens)."""
    ask = [{"role": "user", "content": "Please add two numbers."}]
    first = await client.responses.create(
        model=model,
        input=ask,
        tools=[ADD],
        tool_choice={"type": "function", "name": "add"},
        max_output_tokens=48,
        temperature=0.0,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "add" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["add"])
    assert first.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "the sum is 8"}
    second = await client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[result],
        tools=[ADD],
        max_output_tokens=4,
        temperature=0.0,
    )
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    replay = [*ask, call.model_dump(exclude_none=True), result]
    again = await client.responses.create(
        model=model, input=replay, tools=[ADD], max_output_tokens=4, temperature=0.0
    )
    assert again.usage.input_tokens == second.usage.input_tokens > first.usage.input_tokens
    assert again.output_text == second.output_text


async def auto_reads_the_template_format(client: openai.AsyncOpenAI, model: str) -> None:
    """No --tool-call-parser: the template writes <tool_call>, so "auto" reads hermes blocks
    (written on cue under a regex), whole and streamed; plain text stays a message."""
    for regex, called in ((ADD_CALL, True), ("[a-z]{3,9}", False)):
        kwargs: dict[str, Any] = {
            "model": model,
            "input": "Please add two numbers.",
            "tools": [ADD],
            "max_output_tokens": 64,
            "extra_body": {"structured_outputs": {"regex": regex}},
        }
        whole = await client.responses.create(**kwargs)
        kinds = [item.type for item in whole.output]
        assert kinds == (["function_call"] if called else ["message"]), whole.output
        events = [e async for e in await client.responses.create(**kwargs, stream=True)]
        done = events[-1].response
        assert [item.type for item in done.output] == kinds
        if called:
            args = "".join(
                e.delta for e in events if e.type == "response.function_call_arguments.delta"
            )
            assert args == done.output[0].arguments
            jsonschema.validate(json.loads(args), SCHEMAS["add"])


async def json_schema_format(client: openai.AsyncOpenAI, model: str) -> None:
    parsed = await client.responses.parse(
        model=model, input="A pet, please.", text_format=Pet, max_output_tokens=40
    )
    assert isinstance(parsed.output_parsed, Pet), parsed
    async with client.responses.stream(
        model=model, input="A pet, please.", text_format=Pet, max_output_tokens=40
    ) as stream:
        final = await stream.get_final_response()
    assert final.status == "completed" and isinstance(final.output_parsed, Pet), final
    raw = await client.responses.create(
        model=model,
        input="A pet, please.",
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "pet", "schema": Pet.model_json_schema()}},
    )
    Pet.model_validate_json(raw.output_text)
    assert raw.text.format.type == "json_schema"


async def stored(client: openai.AsyncOpenAI, url: str, model: str) -> None:
    """retrieve == create; store: false and another credential see nothing; delete."""
    made = await client.responses.create(model=model, input="Hi", max_output_tokens=3)
    got = await client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    other = openai.AsyncOpenAI(base_url=url, api_key="someone-else", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(made.id)
    await other.close()
    unkept = await client.responses.create(
        model=model, input="Hi", max_output_tokens=3, store=False
    )
    with pytest.raises(openai.NotFoundError) as e:
        await client.responses.retrieve(unkept.id)
    assert e.value.body["code"] == "response_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as e:
        await client.responses.create(model=model, input="Hi", previous_response_id=unkept.id)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    await client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(made.id)


async def refusals(http: httpx.AsyncClient, model: str) -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"background": True}, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": 3}}}}, "text.format"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tool_choice": {"type": "file_search"}, "tools": [ADD]}, "tool_choice"),
    ]
    for fields, param in bad:
        got = await http.post("/v1/responses", json={"model": model, "input": "x", **fields})
        assert got.status_code == 400, (fields, got.text)
        assert got.json()["error"]["param"].startswith(param), (fields, got.text)
    missing = await http.post("/v1/embeddings", json={"model": model, "input": "x"})
    assert missing.status_code == 404
    error = missing.json()["error"]
    for route in ("POST /v1/embeddings", "POST /v1/chat/completions", "DELETE /v1/responses/"):
        assert route in error["message"], error["message"]
    assert error["code"] == "unknown_url"


async def cut_short(http: httpx.AsyncClient, model: str) -> None:
    """A deadline mid-stream ends it with an `error` event and response.failed; a client that
    leaves mid-stream, or before a whole answer, cancels the request (the pools are checked
    after)."""
    body = {"model": model, "input": "Go on.", "max_output_tokens": 2000, "ignore_eos": True}
    # 2,000 tokens take a tiny model over a second on a fast machine: the deadline comes first
    timeout = {"x-request-timeout": "0.5"}
    async with http.stream(
        "POST", "/v1/responses", json={**body, "stream": True}, headers=timeout
    ) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) async for line in r.aiter_lines() if line[:6] == "data: "]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"], events[-3:]
    assert events[-2]["code"] == "timeout" and events[-1]["response"]["status"] == "failed"
    whole = await http.post("/v1/responses", json=body, headers=timeout)
    assert whole.status_code == 504, whole.text
    async with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        async for _ in r.aiter_lines():
            break  # gone: the request is cancelled
    with pytest.raises(httpx.ReadTimeout):
        await http.post("/v1/responses", json=body, timeout=0.5)


def test_responses_api_on_a_colocated_node(tmp_path: Path) -> None:
    template = tmp_path / "tools.jinja"
    template.write_text(QWEN_TOOLS)
    http_api = {"http_port": 0, "chat_template": str(template)}  # no --tool-call-parser

    async def body() -> None:
        async with pd_cluster("tiny", colocated=True, decode_overrides=http_api) as c:
            url = f"http://127.0.0.1:{c.decodes[0].http_port}"
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                model = (await http.get("/v1/models")).json()["data"][0]["id"]
                await plain_and_streamed(client, model)
                await tool_round_trip(client, model)
                await auto_reads_the_template_format(client, model)
                await json_schema_format(client, model)
                await stored(client, url + "/v1", model)
                await refusals(http, model)
                await cut_short(http, model)
            await client.close()
            await c.assert_idle_and_conserved()

    asyncio.run(asyncio.wait_for(body(), 300))


def test_responses_through_the_proxy_find_their_replica(tmp_path: Path) -> None:
    """Two decode replicas behind the proxy: each turn of a previous_response_id chain, and
    each retrieve, reaches the replica that stored the response it names."""
    from decode_node.server import DecodeNode
    from pdserve.proxy import Proxy
    from shared.model.loader import load_model

    template = tmp_path / "tools.jinja"
    template.write_text(QWEN_TOOLS)
    http_api = {"http_port": 0, "chat_template": str(template)}

    async def body() -> None:
        async with pd_cluster("tiny", decode_overrides=http_api) as c:
            first = c.decodes[0]
            config = replace(first.config, host="127.0.0.2", http_port=first.http_port)
            second = DecodeNode(config, load_model("tiny"))
            await second.start()
            proxy = Proxy([f"127.0.0.1:{first.port}", f"127.0.0.2:{second.port}"])
            await proxy.start("127.0.0.1", 0, http_port=0, backend_http_port=first.http_port)
            try:
                assert proxy.http_server is not None
                url = f"http://127.0.0.1:{proxy.http_server.port}/v1"
                client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
                direct = [f"http://{h}:{first.http_port}/v1" for h in ("127.0.0.1", "127.0.0.2")]
                await chain(client, direct, first.core.loaded.name)
                await client.close()
                await c.assert_idle_and_conserved()
            finally:
                await proxy.stop(1.0)
                assert await second.stop(grace=1.0), "the second replica leaked"

    asyncio.run(asyncio.wait_for(body(), 300))


async def chain(proxied: openai.AsyncOpenAI, direct: list[str], model: str) -> None:
    """A response made on each replica directly, then found through the proxy: retrieved,
    and continued by previous_response_id (the next turn sees the whole conversation)."""
    for base in direct:
        client = openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0)
        made = await client.responses.create(model=model, input="Hi", max_output_tokens=2)
        await client.close()
        assert (await proxied.responses.retrieve(made.id)).id == made.id
        turn = made
        for _ in range(2):
            turn = await proxied.responses.create(
                model=model, input="and?", previous_response_id=turn.id, max_output_tokens=2
            )
            assert turn.usage.input_tokens > made.usage.input_tokens
    with pytest.raises(openai.NotFoundError) as e:
        await proxied.responses.retrieve("resp_nowhere")
    assert e.value.body["code"] == "response_not_found"  # type: ignore[index]


async def pydantic_ai_agent(url: str, model_name: str) -> None:
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIResponsesModel(model_name, provider=OpenAIProvider(base_url=url, api_key="x"))
    words = {"max_tokens": 8, "extra_body": {"structured_outputs": {"regex": "[a-z]{3,9}"}}}
    text = await Agent(model, instructions="Be brief.").run("Say hi.", model_settings=words)
    assert isinstance(text.output, str) and text.output, text
    budget = {"max_tokens": 256, "temperature": 0.8, "extra_body": {"seed": 1}}
    for output in (Pet, NativeOutput(Pet)):  # a final_result tool call; text.format json_schema
        agent = Agent(model, output_type=output)
        done = await agent.run("A pet, please.", model_settings=budget)
        assert isinstance(done.output, Pet), done
        async with agent.run_stream("A pet, please.", model_settings=budget) as streamed:
            assert isinstance(await streamed.get_output(), Pet)


def test_pydantic_ai_responses_model(tmp_path: Path) -> None:
    """pydantic-ai's OpenAIResponsesModel (the `test` extra installs it; pdserve itself does not
    depend on it)."""
    pytest.importorskip("pydantic_ai")

    async def body() -> None:
        template = tmp_path / "tools.jinja"
        template.write_text(QWEN_TOOLS)
        http_api = {"http_port": 0, "chat_template": str(template)}
        async with pd_cluster("tiny", colocated=True, decode_overrides=http_api) as c:
            url = f"http://127.0.0.1:{c.decodes[0].http_port}/v1"
            await pydantic_ai_agent(url, c.decodes[0].core.loaded.name)
            await c.assert_idle_and_conserved()

    asyncio.run(asyncio.wait_for(body(), 300))
