"""Tool calling without a node: the parsers on scripted model text (whole and streamed in every
chunking, which must agree), the chat template's tools and tool messages against transformers'
own rendering, and the request checks and grammars (test_tools_http.py serves them)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from shared.engine.sampling.structured_output import StructuredOutput
from shared.model.chat_template import ChatTemplate
from shared.serving.http.errors import ApiError
from shared.serving.http.schemas import ChatCompletionRequest
from shared.serving.http.structured import structured_output
from shared.serving.http.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    Parsed,
    RequiredParser,
    ToolParser,
    merge_calls,
)
from shared.serving.http.tools import template_message, tool_grammar, tool_parser
from tests.tool_corpus import SCHEMAS, TOOLS


def parse(parser: ToolParser, text: str, step: int) -> tuple[str, list[dict[str, Any]]]:
    """Feed `text` in chunks of `step`; the content and the calls as a whole answer has them."""
    out = Parsed()
    deltas = []
    for i in range(0, len(text), step):
        got = parser.feed(text[i : i + step])
        deltas += [d.as_dict() for d in got.calls]
        out.content += got.content
    end = parser.finish()
    deltas += [d.as_dict() for d in end.calls]
    for d in deltas:  # OpenAI's shape: a call's first delta names it, with empty arguments
        if "id" in d:
            assert d["function"]["arguments"] == "" and d["type"] == "function", d
            assert d["id"].startswith("call_") and d["function"]["name"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in merge_calls(deltas)]
    return out.content + end.content, calls  # type: ignore[return-value]


HERMES_CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("plain answer, <b>no</b> call <tool", "plain answer, <b>no</b> call <tool", []),
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"arguments": {"a": 1, "b": [2, {"c": "}"}]}, "name": "add"}'
        "\n</tool_call>",
        "Let me check.\n",
        [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": [2, {"c": "}"}]}')],
    ),
    # arguments some models encode as a string; a call without arguments
    (
        '<tool_call>{"name": "f", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
        '<tool_call>{"name": "g"}</tool_call> done',
        " done",
        [("f", '{"q": "x"}'), ("g", "{}")],
    ),
    ("a <tool_call> not json", "a <tool_call> not json", []),
    ('<tool_call>{"nam": 1}</tool_call>', '{"nam": 1}', []),  # no name: no call
    ('<tool_call>\n{"name": "f", "arguments": {"a": "b', "", [("f", '{"a": "b')]),  # cut
]
LLAMA_CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    (
        '<|python_tag|>{"name": "f", "parameters": {"q": "a;b"}}; {"name": "g", "parameters": {}}',
        "",
        [("f", '{"q": "a;b"}'), ("g", "{}")],
    ),
    (' {"name": "f", "arguments": {"x": 1}}', "", [("f", '{"x": 1}')]),
    ("The answer is {x}.", "The answer is {x}.", []),
]


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 1000])
def test_hermes_and_llama3_json_parsers_streamed_and_whole(step: int) -> None:
    for cases, new in ((HERMES_CASES, HermesParser), (LLAMA_CASES, Llama3JsonParser)):
        for text, content, calls in cases:
            parser = new()
            assert parse(parser, text, step) == (content, calls), text
            assert parser.called == bool(calls)


def test_required_and_named_parsers_read_what_their_grammar_writes() -> None:
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "g", "parameters": {}}]'
    for step in (1, 4, 100):
        got = parse(RequiredParser(), text, step)
        assert got == ("", [("add", '{"a": 1, "b": 2}'), ("g", "{}")])
        assert parse(NamedParser("add"), '{"a": 1}', step) == ("", [("add", '{"a": 1}')])
    # cut by max_tokens before a name: grammar text, not content
    assert parse(RequiredParser(), '[{"name": "ad', 2) == ("", [])


# Qwen2.5's tool template in its essentials: tools and arguments written with tojson
QWEN_TOOLS = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- if message.content %}{{ '\\n' + message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def request(**fields: Any) -> ChatCompletionRequest:
    messages = fields.pop("messages", [{"role": "user", "content": "hi"}])
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})


def test_template_gets_tools_and_tool_messages_as_transformers_passes_them() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "greet", "arguments": '{"name": "<é>"}'},
    }
    messages = [
        {"role": "user", "content": "greet bo"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "hello bo"},
    ]
    req = request(messages=messages, tools=TOOLS[3:5])
    ours = ChatTemplate(QWEN_TOOLS).render(
        [template_message(m) for m in req.messages], tools=req.tools
    )
    # transformers' documented shape: arguments as an object, content "" (vLLM's for null)
    theirs_messages = json.loads(json.dumps(messages))
    theirs_messages[1]["content"] = ""
    theirs_messages[1]["tool_calls"][0]["function"]["arguments"] = {"name": "<é>"}
    theirs = render_jinja_template(
        [theirs_messages], tools=TOOLS[3:5], chat_template=QWEN_TOOLS, add_generation_prompt=True
    )[0][0]
    assert ours == theirs
    assert '"arguments": {"name": "<é>"}' in ours and '"name": "greet", "description"' in ours


def test_tool_choice_checks_and_grammars() -> None:
    bad: list[tuple[dict[str, Any], str, str]] = [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        ({"tools": [{"type": "function", "function": {}}]}, "tools", "name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "second tool"),
        ({"tools": TOOLS, "functions": [TOOLS[0]["function"]]}, "functions", "not both"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tools",
            "only one structured output",
        ),
    ]
    for fields, param, message in bad:
        with pytest.raises(ApiError, match=message) as e:
            req = request(**fields)
            structured_output(req)
        assert e.value.param == param, fields
    # "auto", the default with tools, with no parser (none given, none in the template): text
    assert tool_parser(request(tools=TOOLS), None) is None
    assert isinstance(tool_parser(request(tools=TOOLS), "hermes")(), HermesParser)  # type: ignore[misc]
    assert tool_parser(request(tools=TOOLS, tool_choice="none"), None) is None
    # named: the tool's arguments; the deprecated functions/function_call spell the same
    named = {"type": "function", "function": {"name": "add"}}
    spec = tool_grammar(request(tools=TOOLS, tool_choice=named))
    assert spec == StructuredOutput("json_schema", json.dumps(SCHEMAS["add"]))
    old = request(functions=[t["function"] for t in TOOLS], function_call={"name": "add"})
    assert tool_grammar(old) == spec
    required = tool_grammar(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert required is not None
    schema = json.loads(required.spec)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == len(TOOLS)
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "parameters": {"city": "Paris"}}], schema)
