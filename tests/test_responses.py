"""The Responses API without a node: input items read into the chat messages the template gets,
the stored responses' bounds (bytes, entries, least recently used first, per credential), the
tool-call parser chosen from a chat template, and Mistral's call format streamed in every
chunking (test_responses_http.py serves them)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared.model.chat_template import ChatTemplate
from shared.serving.http.errors import ApiError
from shared.serving.http.response_store import ResponseStore, StoredResponse, owner_of
from shared.serving.http.responses_input import chat_request
from shared.serving.http.responses_schemas import ResponsesRequest
from shared.serving.http.template_tools import parser_for_template
from shared.serving.http.tool_parsers import MistralParser
from shared.serving.http.tools import tool_parser
from tests.test_tools import QWEN_TOOLS, parse, request
from tests.tool_corpus import TOOLS


def responses(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


OK_PART = {"type": "output_text", "text": "ok"}


def test_input_items_become_the_chat_turns() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'}
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "add"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "ok"}],
        },
        call,
        {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "2"},
    ]
    tool = {"type": "function", "name": "add", "parameters": {"type": "object"}, "strict": True}
    chat = chat_request(
        responses(input=items, instructions="be brief", tools=[tool], max_output_tokens=5), [], {}
    )
    got = [m.model_dump(exclude_none=True) for m in chat.messages]
    calls = [
        {"id": c, "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
        for c in ("c1", "c2")
    ]
    assert got == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": "ok", "tool_calls": calls},  # one turn: one message
        {"role": "tool", "content": "2", "name": "add", "tool_call_id": "c1"},
    ]
    assert chat.tools == [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    ]
    assert chat.max_tokens == 5
    # a function_call_output answering a call of an earlier (stored) turn gets its name too
    history = [{"role": "assistant", "content": None, "tool_calls": calls[:1]}]
    later = chat_request(responses(input=[items[-1]]), history, {})
    assert later.messages[-1].name == "add"


def test_text_format_and_tool_choice_take_their_chat_spellings() -> None:
    schema = {"type": "object"}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}
    chat = chat_request(responses(text=fmt, tool_choice={"type": "function", "name": "f"}), [], {})
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": schema, "strict": True},
    }
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    passed = chat_request(responses(), [], {"seed": 3, "ignore_eos": True, "bogus": 1})
    assert passed.seed == 3 and passed.ignore_eos
    logprobs = ["message.output_text.logprobs"]
    with pytest.raises(ApiError, match="background, include") as e:
        chat_request(responses(background=True, include=logprobs), [], {})
    assert e.value.param == "background"
    chat_request(responses(include=["reasoning.encrypted_content"]), [], {})  # none written


def entry(owner: str, size: int) -> StoredResponse:
    return StoredResponse(owner, b"x" * (size - len(owner) - 2), b"[]")


def test_the_store_is_bounded_in_bytes_and_entries_lru_first_per_owner() -> None:
    a, b = owner_of("Bearer a"), owner_of("Bearer b")
    assert a != b and "Bearer" not in a
    store = ResponseStore(max_bytes=1000, max_entries=3)
    for i in range(3):
        assert store.put(f"r{i}", entry(a, 300))
    assert store.get("r0", a) is not None  # r0 is now the most recently used
    assert store.get("r0", b) is None  # another credential: not found
    store.put("r3", entry(a, 300))  # over 1000 bytes: r1, the least recently used, goes
    assert list(store.entries) == ["r2", "r0", "r3"] and store.bytes == 900
    store.put("r4", entry(b, 100))  # 1000 bytes, but 4 entries: r2 goes
    assert list(store.entries) == ["r0", "r3", "r4"] and store.bytes == 700
    assert not store.put("huge", entry(a, 1001)) and "huge" not in store.entries
    assert not store.delete("r4", a) and store.delete("r4", b)
    assert store.bytes == 600 and store.get("r4", b) is None
    assert json.loads(store.entries["r0"].conversation) == []
    for keep_none in (ResponseStore(0, 10), ResponseStore(1000, 0)):  # --responses-store-* 0
        assert not keep_none.put("r", entry(a, 100)) and keep_none.get("r", a) is None


CHATML_NO_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)
MISTRAL = (
    "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}"
    "{% else %}[INST] {{ m.content }} [/INST]{% endif %}{% endfor %}"
)
LLAMA3 = (
    "<|start_header_id|>{% for m in messages %}{% if m.tool_calls %}"
    '{"name": "{{ m.tool_calls[0].function.name }}", "parameters": '
    "{{ m.tool_calls[0].function.arguments | tojson }}}{% endif %}{% endfor %}{{ tools }}"
)


def test_the_parser_follows_the_template_and_none_means_plain_text() -> None:
    cases = [
        (QWEN_TOOLS, "hermes"),
        (MISTRAL, "mistral"),
        (LLAMA3, "llama3_json"),
        ("<|python_tag|>{{ messages }}", "llama3_json"),
        (CHATML_NO_TOOLS, None),
    ]
    for source, parser in cases:
        assert parser_for_template(ChatTemplate(source)) == parser, source
    assert parser_for_template(None) is None
    # "auto" with a template that writes no calls: no parser, the answer is plain text
    assert tool_parser(request(tools=TOOLS), None) is None


MISTRAL_CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    (
        '[TOOL_CALLS] [{"name": "f", "arguments": {"q": "a]"}}, {"name": "g", "arguments": {}}]',
        "",
        [("f", '{"q": "a]"}'), ("g", "{}")],
    ),
    ('[{"name": "f", "arguments": {"x": 1}}]', "", [("f", '{"x": 1}')]),  # the tag dropped
    ("[1, 2] is a list", "[1, 2] is a list", []),
    ("Plain [TOOL words", "Plain [TOOL words", []),
    ("[", "[", []),
]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_mistral_parser_streamed_and_whole(step: int) -> None:
    for text, content, calls in MISTRAL_CASES:
        parser = MistralParser()
        assert parse(parser, text, step) == (content, calls), (text, step)
        assert parser.called == bool(calls)
