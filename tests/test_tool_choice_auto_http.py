"""tool_choice "auto" (the default with tools) on nodes started without --tool-call-parser, through
the official `openai` SDK and LangChain's `bind_tools`: a chat template that writes no tool calls
answers plain text (never a 400), whole and streamed, a tool turn included; a template that
writes `<tool_call>` blocks gets them read as calls."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.engine_helpers import CHATML, single_torch_thread
from tests.support.cluster import pd_cluster
from tests.test_tools import QWEN_TOOLS
from tests.tool_corpus import SCHEMAS, TOOLS, ask

ADD_CALL = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}\n</tool_call>'
WORDS = {"structured_outputs": {"regex": "[a-z]{3,9}"}}  # some text, whatever the weights


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_torch_thread():
        yield


async def plain_text(client: openai.AsyncOpenAI, model: str) -> None:
    """No calls in the template: "auto" is text, whole and streamed, after a tool turn too."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    turns: list[list[dict[str, Any]]] = [
        ask("add"),
        [
            *ask("add"),
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "8"},
        ],
    ]
    for messages in turns:
        kwargs = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": 8}
        kwargs["temperature"] = 0.0
        whole = await client.chat.completions.create(**kwargs, extra_body=WORDS)
        choice = whole.choices[0]
        assert choice.message.content and choice.message.tool_calls is None, choice
        assert choice.finish_reason in ("stop", "length")
        stream = await client.chat.completions.create(**kwargs, stream=True, extra_body=WORDS)
        chunks = [c.choices[0] async for c in stream]
        assert not any(c.delta.tool_calls for c in chunks)
        assert "".join(c.delta.content or "" for c in chunks) == choice.message.content


async def template_calls(client: openai.AsyncOpenAI, model: str) -> None:
    """The template writes <tool_call>: "auto" reads the model's block as a call."""
    whole = await client.chat.completions.create(
        model=model,
        messages=ask("add"),
        tools=TOOLS,
        max_tokens=96,
        extra_body={"structured_outputs": {"regex": ADD_CALL}},
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["add"])


async def langchain_bind_tools(url: str, model: str, called: bool) -> None:
    """LangChain's bind_tools (tool_choice unset: "auto"), then a tool turn answered in text."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    def chat(regex: str) -> ChatOpenAI:
        return ChatOpenAI(
            model=model,
            base_url=url,
            api_key="x",  # type: ignore[arg-type]
            max_tokens=96,  # type: ignore[call-arg]
            temperature=0.0,
            extra_body={"structured_outputs": {"regex": regex}},
        )

    words = WORDS["structured_outputs"]["regex"]
    tools = [t["function"] for t in TOOLS]
    asked = [HumanMessage("Please add two numbers.")]
    first = await chat(ADD_CALL if called else words).bind_tools(tools).ainvoke(asked)
    assert bool(first.tool_calls) == called, first
    if not called:
        assert first.content
        return
    assert first.tool_calls[0]["name"] == "add"
    result = ToolMessage("8", tool_call_id=first.tool_calls[0]["id"])
    second = await chat(words).bind_tools(tools).ainvoke([*asked, first, result])
    assert second.content and not second.tool_calls, second


def test_auto_without_a_parser_flag(tmp_path: Path) -> None:
    has_langchain = True
    try:
        import langchain_openai  # noqa: F401  (pdserve does not depend on it)
    except ImportError:
        has_langchain = False

    async def node(template: str, check: Any, called: bool) -> None:
        path = tmp_path / "template.jinja"
        path.write_text(template)
        http = {"http_port": 0, "chat_template": str(path)}
        async with pd_cluster("tiny", colocated=True, decode_overrides=http) as c:
            url = f"http://127.0.0.1:{c.decodes[0].http_port}/v1"
            model = c.decodes[0].core.loaded.name
            client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
            await check(client, model)
            if has_langchain:
                await langchain_bind_tools(url, model, called)
            await client.close()
            await c.assert_idle_and_conserved()

    async def body() -> None:
        await node(CHATML, plain_text, called=False)
        await node(QWEN_TOOLS, template_calls, called=True)

    asyncio.run(asyncio.wait_for(body(), 300))
