"""OpenAI's deprecated function calling over HTTP, through the official `openai` SDK, on a node
serving the tiny model with a template that renders tools: `functions` with a named
`function_call` answers `message.function_call` (arguments fitting the schema) and finish_reason
`function_call`, streamed as `delta.function_call` adding up to the same; "auto" reads the
model's hermes block into the same shape; a call -> `function` result -> answer exchange reaches
the template as the tool exchange it knows; `tools` with `functions` is a 400. /tokenize with
`tools` or `functions` counts exactly the prompt the chat endpoint runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.engine_helpers import single_torch_thread
from tests.support.cluster import pd_cluster
from tests.test_tools import QWEN_TOOLS
from tests.tool_corpus import SCHEMAS, TOOLS, ask

FUNCTIONS = [t["function"] for t in TOOLS]
ADD_CALL = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}\n</tool_call>'


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


def test_legacy_messages_reach_the_template_as_a_tool_exchange() -> None:
    """An assistant's `function_call` is its one tool call, a `function` message a tool's
    result with its name: what tool-aware templates render."""
    from shared.serving.http.schemas import ChatMessage
    from shared.serving.http.tools import template_message

    call = {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    asked = ChatMessage.model_validate(
        {"role": "assistant", "content": None, "function_call": call}
    )
    answered = ChatMessage.model_validate({"role": "function", "name": "add", "content": "3"})
    function = {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert template_message(asked) == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "", "type": "function", "function": function}],
    }
    assert template_message(answered) == {"role": "tool", "content": "3", "name": "add"}


async def named(client: Any, model: str) -> None:
    """A named function: its call, whole and streamed (greedy: the same call)."""
    kwargs = {
        "model": model,
        "messages": ask("add"),
        "functions": FUNCTIONS,
        "max_tokens": 64,
        "temperature": 0.0,
    }
    whole = await client.chat.completions.create(**kwargs, function_call={"name": "add"})
    choice = whole.choices[0]
    assert choice.finish_reason == "function_call", choice
    message = choice.message
    assert message.tool_calls is None and message.content is None, message
    assert message.function_call.name == "add"
    jsonschema.validate(json.loads(message.function_call.arguments), SCHEMAS["add"])
    stream = await client.chat.completions.create(
        **kwargs, function_call={"name": "add"}, stream=True
    )
    name, arguments, finish = None, "", []
    async for chunk in stream:
        delta = chunk.choices[0].delta
        finish.append(chunk.choices[0].finish_reason)
        assert not delta.tool_calls, delta
        if delta.function_call is not None:
            if delta.function_call.name is not None:
                assert name is None and arguments == "", delta  # the name comes first, once
                name = delta.function_call.name
            arguments += delta.function_call.arguments or ""
    assert finish[-1] == "function_call" and not any(finish[:-1]), finish
    assert (name, arguments) == ("add", message.function_call.arguments)


async def auto(client: Any, model: str) -> None:
    """ "auto" (the default with functions): the node's hermes parser reads the model's block
    (written on cue under a regex) into the same shape; plain text stays content."""
    for regex, called in ((ADD_CALL, True), ("[a-z]{3,9}", False)):
        got = await client.chat.completions.create(
            model=model,
            messages=ask("add"),
            functions=FUNCTIONS,
            max_tokens=96,
            extra_body={"structured_outputs": {"regex": regex}},
        )
        choice = got.choices[0]
        assert choice.finish_reason == ("function_call" if called else "stop"), choice
        assert choice.message.tool_calls is None
        if called:
            assert choice.message.function_call.name == "add" and not choice.message.content
            jsonschema.validate(json.loads(choice.message.function_call.arguments), SCHEMAS["add"])
        else:
            assert choice.message.function_call is None and choice.message.content


async def two_turns(client: Any, http: httpx.AsyncClient, model: str) -> None:
    """call -> the function's result -> an answer; the template got the call and the result
    (as tool_calls and a tool message), and /tokenize counts that very prompt."""
    messages: list[Any] = ask("add")
    first = await client.chat.completions.create(
        model=model,
        messages=messages,
        functions=FUNCTIONS,
        function_call={"name": "add"},
        max_tokens=64,
    )
    call = first.choices[0].message.function_call
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "function", "name": "add", "content": "the sum is 8"},
    ]
    second = await client.chat.completions.create(
        model=model, messages=messages, functions=FUNCTIONS, function_call="none", max_tokens=4
    )
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.function_call is None
    body = {"model": model, "messages": messages, "functions": FUNCTIONS}
    tokens = (await http.post("/tokenize", json=body)).json()
    assert tokens["count"] == second.usage.prompt_tokens
    prompt = (await http.post("/detokenize", json={"tokens": tokens["tokens"]})).json()["prompt"]
    arguments = json.dumps(json.loads(call.arguments))  # the template writes them with tojson
    assert f'<tool_call>\n{{"name": "add", "arguments": {arguments}}}\n</tool_call>' in prompt
    assert "<tool_response>\nthe sum is 8\n</tool_response>" in prompt


async def tools_and_functions_refused(client: Any, model: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model=model, messages=ask("add"), tools=TOOLS, functions=FUNCTIONS, max_tokens=4
        )
    assert err.value.body["param"] == "functions"
    assert "not both" in err.value.body["message"]


async def tokenize_with_tools(http: httpx.AsyncClient, model: str) -> None:
    """/tokenize with tools (or the same as functions) is the chat endpoint's prompt: its count
    is the completion's prompt_tokens, and the tools are in it."""
    counts = {}
    for field, value in (("tools", TOOLS), ("functions", FUNCTIONS), (None, None)):
        extra = {} if field is None else {field: value}
        body = {"model": model, "messages": ask("greet"), **extra}
        tokens = await http.post("/tokenize", json=body)
        assert tokens.status_code == 200, tokens.text
        choice = "function_call" if field == "functions" else "tool_choice"
        chat = {**body, "max_tokens": 1, **({choice: "none"} if field else {})}
        done = await http.post("/v1/chat/completions", json=chat)
        assert done.status_code == 200, done.text
        counts[field] = tokens.json()["count"]
        assert counts[field] == done.json()["usage"]["prompt_tokens"], field
    assert counts["tools"] == counts["functions"] > counts[None] + 100  # the tools were rendered
    both = {"messages": ask("greet"), "tools": TOOLS, "functions": FUNCTIONS}
    refused = await http.post("/tokenize", json=both)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "functions"


def test_legacy_functions_and_tokenize_with_tools(tmp_path: Path) -> None:
    import openai

    template = tmp_path / "tools.jinja"
    template.write_text(QWEN_TOOLS)
    http_api = {"http_port": 0, "chat_template": str(template), "tool_call_parser": "hermes"}

    async def body() -> None:
        async with pd_cluster("tiny", colocated=True, decode_overrides=http_api) as c:
            url = f"http://127.0.0.1:{c.decodes[0].http_port}"
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                model = (await http.get("/v1/models")).json()["data"][0]["id"]
                await named(client, model)
                await auto(client, model)
                await two_turns(client, http, model)
                await tools_and_functions_refused(client, model)
                await tokenize_with_tools(http, model)
            await client.close()
            await c.assert_idle_and_conserved()

    asyncio.run(asyncio.wait_for(body(), 300))
