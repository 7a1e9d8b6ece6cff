"""Tool calling's request side: `tools` (and OpenAI's deprecated `functions`) checked, the chat
template's `tools` and message variables as transformers passes them, `tool_choice` read, and
for "required" or a named tool the grammar that makes any model write a valid call.

The grammar travels as a json_schema StructuredOutput, the path response_format takes (the
prefill node samples the first token under it). "auto" reads calls out of free text with the
node's `--tool-call-parser`, else the parser for the format the chat template writes
(template_tools.py); a template that writes no calls answers "auto" with plain text.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from shared.engine.sampling.structured_output import StructuredOutput
from shared.serving.http.errors import ApiError
from shared.serving.http.legacy_functions import function_call
from shared.serving.http.schemas import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    TextPart,
    ToolCall,
)
from shared.serving.http.tool_parsers import (
    TOOL_PARSERS,
    NamedParser,
    RequiredParser,
    ToolParser,
    merge_calls,
)

if TYPE_CHECKING:
    from shared.serving.http.tokenization_schemas import TokenizeChatRequest

Mode = Literal["none", "auto", "required", "named"]
ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a tool without `parameters`


@dataclass(frozen=True)
class ToolChoice:
    mode: Mode
    name: str | None = None  # the named tool


def tool_definitions(
    req: ChatCompletionRequest | TokenizeChatRequest,
) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template gets them (None: no tools)."""
    if req.tools and req.functions:
        raise ApiError(
            400,
            "set tools (with tool_choice) or the deprecated functions (with function_call), not "
            "both: the answer's shape follows the one used (tool_calls or function_call)",
            param="functions",
        )
    if req.functions:
        tools = [{"type": "function", "function": f} for f in req.functions]
        field = "functions"
    elif req.tools:
        tools, field = list(req.tools), "tools"
    else:
        return None
    names: set[str] = set()
    for i, tool in enumerate(tools):
        name = _checked_tool(tool, f"{field}[{i}]")
        if name in names:
            raise ApiError(400, f"{field}[{i}]: a second tool named {name!r}", param=field)
        names.add(name)
    return tools


def _checked_tool(tool: Any, where: str) -> str:
    field = where.split("[")[0]
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ApiError(400, f'{where} must be {{"type": "function", "function": ...}}', param=field)
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{where}.function.name must be a non-empty string", param=field)
    params = function.get("parameters")  # type: ignore[union-attr]
    if params is not None and not isinstance(params, dict):
        raise ApiError(400, f"{where}.function.parameters must be a JSON schema", param=field)
    return name


def tool_choice(req: ChatCompletionRequest) -> ToolChoice:
    """OpenAI's default: "auto" with tools, "none" without."""
    tools = tool_definitions(req)
    field = "function_call" if req.functions else "tool_choice"
    value = req.function_call if req.functions else req.tool_choice
    if isinstance(value, dict) and field == "function_call":
        value = {"type": "function", "function": value}  # {"name": ...}, the old spelling
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if tools is None and value != "none":
            raise ApiError(400, f"{field} {value!r} needs tools", param=field)
        return ToolChoice(value)
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or value.get("type") != "function":  # type: ignore[union-attr]
        raise ApiError(
            400,
            f'{field} must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param=field,
        )
    if name not in {t["function"]["name"] for t in tools or []}:
        raise ApiError(400, f"{field} names {name!r}, which is not among the tools", param=field)
    return ToolChoice("named", name)


def tool_grammar(req: ChatCompletionRequest) -> StructuredOutput | None:
    """The grammar a "required" or named choice constrains the output to: the named tool's
    arguments object, or vLLM's `[{"name": ..., "parameters": {...}}, ...]` for any tool."""
    choice = tool_choice(req)
    if choice.mode in ("none", "auto"):
        return None
    functions = {t["function"]["name"]: t["function"] for t in tool_definitions(req) or []}
    if choice.mode == "named":
        schema = functions[choice.name].get("parameters") or ANY_OBJECT  # type: ignore[index]
        return StructuredOutput("json_schema", json.dumps(schema))
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "parameters": f.get("parameters") or ANY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, f in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if req.parallel_tool_calls is False or req.functions:  # the deprecated shape has one call
        schema["maxItems"] = 1
    return StructuredOutput("json_schema", json.dumps(schema))


def tool_parser(req: ChatCompletionRequest, parser: str | None) -> Callable[[], ToolParser] | None:
    """What reads the choices' text into tool calls (None: plain text, no calls)."""
    choice = tool_choice(req)
    if choice.mode == "named":
        return functools.partial(NamedParser, choice.name)  # type: ignore[arg-type]
    if choice.mode == "required":
        return RequiredParser
    if choice.mode == "none":
        return None
    if parser is None:  # the template writes no tool calls: the model answers in text
        return None
    return TOOL_PARSERS[parser]


def template_message(m: ChatMessage) -> dict[str, Any]:
    """One message as the chat template gets it: a null content as "" (vLLM's), an assistant's
    calls with their arguments parsed into objects where they are JSON (templates write them
    with `tojson`, as transformers documents). The deprecated spelling comes as the tool
    exchange templates know: an assistant's `function_call` as its one tool call, a `function`
    message as a `tool` one (its name kept)."""
    role = "tool" if m.role == "function" else m.role
    out: dict[str, Any] = {"role": role, "content": _content(m)}
    calls = m.tool_calls
    if calls is None and m.function_call is not None:
        calls = [ToolCall(function=m.function_call)]
    if calls is not None:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(c)},
            }
            for c in calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if role == "tool" and m.name is not None:
        out["name"] = m.name
    return out


def _content(m: ChatMessage) -> str | list[dict[str, str]]:
    """Text, or (with images) the parts as vision chat templates read them: each image as
    `{"type": "image"}`, where the template writes the image's placeholder."""
    if not m.image_parts():
        return m.text()
    assert isinstance(m.content, list)
    return [
        {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
        for part in m.content
    ]


def _arguments(call: ToolCall) -> Any:
    args = call.function.arguments
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            return args
        return parsed if isinstance(parsed, dict) else args
    return args


def assistant_message(
    content: str, deltas: list[dict[str, Any]] | None, legacy: bool = False
) -> AssistantMessage:
    """A whole answer's message: with calls, content is null unless the model wrote more;
    `legacy` (the request's `functions`): the first call as `function_call`."""
    if not deltas:
        return AssistantMessage(content=content)
    text = content if content.strip() else None
    if legacy:
        return AssistantMessage(content=text, function_call=function_call(deltas))
    calls = [ToolCall.model_validate(c) for c in merge_calls(deltas)]
    return AssistantMessage(content=text, tool_calls=calls)
