"""Tool calling on a P/D cluster serving SmolLM2, through the official `openai` SDK: named and
required choices return a valid call for every tool of a corpus, streamed deltas have OpenAI's
shape, "auto" reads the hermes format, a call -> result -> answer exchange works, the SDK's
parse helper and LangChain's with_structured_output work, and every seat, block and grammar
matcher is back after success, cancel and timeout."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import jsonschema
import pytest

from tests.support.shared_cluster import SharedCluster
from tests.tool_corpus import SCHEMAS, TOOLS, ask


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 400))


def valid(call: Any, name: str | None = None) -> None:
    """A call of a listed tool (or of `name`) whose arguments fit that tool's schema."""
    assert call.type == "function" and call.id.startswith("call_"), call
    assert call.function.name in SCHEMAS and name in (None, call.function.name), call
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def named_and_required(client: Any, model: str) -> None:
    """Every tool named, and "required" (one call) asked about every tool: a valid call."""
    named = [
        {"tool_choice": {"type": "function", "function": {"name": n}}, "name": n} for n in SCHEMAS
    ]
    required = [{"tool_choice": "required", "parallel_tool_calls": False, "name": None}] * 6
    cases = [(case, ask(n)) for case, n in zip(named + required, [*SCHEMAS] * 2, strict=True)]
    answers = await asyncio.gather(
        *(
            client.chat.completions.create(
                model=model,
                messages=messages,
                tools=TOOLS,
                max_tokens=48,
                temperature=0.8,
                seed=i,
                **{k: v for k, v in case.items() if k != "name"},
            )
            for i, (case, messages) in enumerate(cases)
        )
    )
    for (case, _), a in zip(cases, answers, strict=True):
        choice = a.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and len(choice.message.tool_calls) == 1, choice
        valid(choice.message.tool_calls[0], case["name"])


async def streamed(client: Any, model: str) -> None:
    """OpenAI's deltas: the first names the call (arguments ""), then argument fragments;
    finish_reason tool_calls last. Parallel calls each get their index."""
    for choice in ({"type": "function", "function": {"name": "move"}}, "required"):
        stream = await client.chat.completions.create(
            model=model,
            messages=ask("move"),
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=64,
            temperature=0.0,
            stream=True,
        )
        calls: dict[int, dict[str, str]] = {}
        finish = []
        async for chunk in stream:
            delta = chunk.choices[0].delta
            finish.append(chunk.choices[0].finish_reason)
            for d in delta.tool_calls or []:
                if d.id is not None:
                    assert d.function.arguments == "" and d.index not in calls, d
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    calls[d.index]["arguments"] += d.function.arguments
        assert calls and list(calls) == list(range(len(calls)))
        assert finish[-1] in ("tool_calls", "length") and not any(finish[:-1]), finish
        done = calls if finish[-1] == "tool_calls" else dict(list(calls.items())[:-1])
        for call in done.values():
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


ADD_CALL = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}\n</tool_call>'


async def auto_hermes(client: Any, model: str) -> None:
    """ "auto" reads the model's own hermes blocks (here the model is made to write one with a
    regex, the only way a small model writes one on cue); plain text stays content."""
    for regex, called in ((ADD_CALL, True), ("[a-z]{3,9}", False)):
        for stream in (False, True):
            got = await client.chat.completions.create(
                model=model,
                messages=ask("add"),
                tools=TOOLS,
                max_tokens=96,
                stream=stream,
                extra_body={"structured_outputs": {"regex": regex}},
            )
            if stream:
                chunks = [c.choices[0] async for c in got]
                args = "".join(
                    d.function.arguments for c in chunks for d in c.delta.tool_calls or []
                )
                content = "".join(c.delta.content or "" for c in chunks)
                finish = chunks[-1].finish_reason
            else:
                message, finish = got.choices[0].message, got.choices[0].finish_reason
                args = message.tool_calls[0].function.arguments if called else ""
                content = message.content or ""
            assert finish == ("tool_calls" if called else "stop"), got
            assert bool(args) == called and bool(content) != called, (args, content)
            if called:
                jsonschema.validate(json.loads(args), SCHEMAS["add"])


async def two_turns(client: Any, model: str) -> None:
    """call -> the tool's result -> an answer (the template gets the call and the result)."""
    messages: list[Any] = ask("get_weather")
    first = await client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        max_tokens=32,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = first.choices[0].message.tool_calls[0]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = await client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=16, temperature=0.0
    )
    assert second.choices[0].finish_reason in ("stop", "length"), second
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 5


async def sdk_parse(client: Any, model: str) -> None:
    """The SDK's parse helper, with a pydantic response_format and with a pydantic tool."""
    import openai
    import pydantic

    class Light(pydantic.BaseModel):
        on: bool
        room: Literal["hall", "bath"]

    done = await client.chat.completions.parse(
        model=model, messages=ask("set_light"), response_format=Light, max_tokens=40
    )
    assert isinstance(done.choices[0].message.parsed, Light), done
    done = await client.chat.completions.parse(
        model=model,
        messages=ask("set_light"),
        max_tokens=40,
        tools=[openai.pydantic_function_tool(Light)],
        tool_choice={"type": "function", "function": {"name": "Light"}},
    )
    assert isinstance(done.choices[0].message.tool_calls[0].function.parsed_arguments, Light)


async def cancel_and_timeout(url: str, model: str) -> None:
    """A stream the client leaves, and a request past its X-Request-Timeout, mid-grammar."""
    import httpx

    body = {
        "model": model,
        "messages": ask("pick"),
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 200,
        "ignore_eos": False,
    }
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream(
            "POST", url + "/chat/completions", json={**body, "stream": True}
        ) as r:
            assert r.status_code == 200
            async for _ in r.aiter_lines():
                break  # gone: the request is cancelled on both nodes
        late = await client.post(
            url + "/chat/completions", json=body, headers={"x-request-timeout": "0.2"}
        )
        assert late.status_code == 504, late.text


def assert_grammars_released(nodes: list[Any]) -> None:
    for node in nodes:
        assert all(m is None for m in node.core.sampler.grammars.matchers), "a matcher is held"


def test_smollm2_tools_over_http_pd(smollm2_pd: SharedCluster) -> None:
    """On the shared SmolLM2 cluster (its decode node reads hermes tool calls)."""
    import openai

    c = smollm2_pd.cluster

    async def body() -> None:
        url = f"http://127.0.0.1:{c.decodes[0].http_port}/v1"
        model = c.decodes[0].core.loaded.name
        client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
        for part in (named_and_required, streamed, auto_hermes, two_turns, sdk_parse):
            await part(client, model)
        await c.assert_idle_and_conserved()
        await cancel_and_timeout(url, model)
        await c.assert_idle_and_conserved()
        assert_grammars_released([*c.prefills, *c.decodes])
        await client.close()

    smollm2_pd.run(asyncio.wait_for(body(), 400), timeout=420)


def test_langchain_structured_output_and_tools(smollm2_colocated: SharedCluster) -> None:
    """LangChain's with_structured_output, as JSON schema and as a forced tool call, and
    `bind_tools` with its default tool_choice and a tool turn on a node started without any tool
    flag (the shared colocated SmolLM2 node; the `test` extra installs langchain-openai, pdserve
    itself does not depend on it)."""
    pytest.importorskip("langchain_openai")
    import pydantic
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    class Pet(pydantic.BaseModel):
        kind: Literal["cat", "dog"]
        legs: int = pydantic.Field(ge=0, le=4)

    @tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    async def body() -> None:
        c = smollm2_colocated.cluster
        llm = ChatOpenAI(
            model=c.decodes[0].core.loaded.name,
            base_url=f"http://127.0.0.1:{c.decodes[0].http_port}/v1",
            api_key="x",  # type: ignore[arg-type]
            max_tokens=40,  # type: ignore[call-arg]
            temperature=0.0,
        )
        for method in ("json_schema", "function_calling"):
            pet = await llm.with_structured_output(Pet, method=method).ainvoke("a pet")
            assert isinstance(pet, Pet), (method, pet)
        ask = HumanMessage("What is the weather in Paris?")
        auto = await llm.bind_tools([weather]).ainvoke([ask])  # tool_choice "auto": no 400
        assert auto.tool_calls or auto.content, auto
        forced = await llm.bind_tools([weather], tool_choice="weather").ainvoke([ask])
        (call,) = forced.tool_calls
        assert call["name"] == "weather" and isinstance(call["args"].get("city"), str), call
        turn = [ask, forced, ToolMessage("sunny", tool_call_id=call["id"])]
        answer = await llm.bind_tools([weather]).ainvoke(turn)
        assert isinstance(answer.content, str) and answer.content, answer
        await c.assert_idle_and_conserved()

    smollm2_colocated.run(asyncio.wait_for(body(), 400), timeout=420)
