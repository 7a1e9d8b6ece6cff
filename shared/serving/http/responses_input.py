"""A Responses API request as the chat-completions request it runs as.

`input` (a string, or message, function_call and function_call_output items) becomes chat
messages: function_call items join the assistant message before them as its `tool_calls`, a
function_call_output is a `tool` message answering its call (with the call's name, which some
templates write). `instructions` is a system message first; function tools, `tool_choice` and
`text.format` take their chat spellings; a message's `input_image` parts become chat's
`image_url` parts (a vision model's images: the chat path decodes and checks them). The chat path
then renders the template, reads tool calls and compiles the grammar exactly as for
/v1/chat/completions.
"""

from __future__ import annotations

from typing import Any

import pydantic

from shared.serving.http.errors import ApiError
from shared.serving.http.responses_schemas import ResponsesRequest, TextFormat
from shared.serving.http.schemas import ChatCompletionRequest

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
# vLLM's sampling extensions a Responses client may send (extra_body), passed on to chat
_PASSED_ON = ("seed", "top_k", "min_p", "repetition_penalty", "stop", "ignore_eos", "priority")
_PASSED_ON += ("structured_outputs", "chat_template_kwargs")


def input_messages(
    value: str | list[dict[str, Any]], history: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`input` as chat messages (dicts ChatMessage validates), after `history`'s."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            _function_call(item, where, out)
        elif kind == "function_call_output":
            out.append(_function_output(item, where, [*history, *out]))
        else:
            raise ApiError(
                400,
                f"{where}.type {kind!r} is not supported: pdserve takes message, function_call "
                "and function_call_output items",
                param="input",
            )
    return out


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string", param="input")
    return value


def _text(content: Any, where: str) -> str:
    """A string, or text parts joined by newlines (as chat's content parts are)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):  # type: ignore[union-attr]
            raise _unsupported(f"{where}[{j}]", kind)
        texts.append(part["text"])
    return "\n".join(texts)


def _unsupported(where: str, kind: object) -> ApiError:
    return ApiError(
        400,
        f"{where}: only text parts ({', '.join(_TEXT_PARTS)}) and input_image parts are "
        f"supported, got {kind!r}",
        param="input",
    )


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(_ROLES)}", param="input")
    content = item.get("content")
    if _has_images(content):
        return {"role": role, "content": _parts(content, f"{where}.content")}
    return {"role": role, "content": _text(content, f"{where}.content")}


def _has_images(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") == "input_image" for part in content
    )


def _parts(content: list[Any], where: str) -> list[dict[str, Any]]:
    """Text and `input_image` parts as chat's `text` and `image_url` parts, in order."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
            continue
        if kind != "input_image":
            raise _unsupported(f"{where}[{j}]", kind)
        url = part.get("image_url")
        if not isinstance(url, str):
            raise ApiError(
                400,
                f"{where}[{j}].image_url must be a string (a data: URL, or an http(s) URL the "
                "operator allowed); file_id images need OpenAI's file store",
                param="input",
            )
        image: dict[str, Any] = {"url": url}
        if part.get("detail") is not None:
            image["detail"] = part["detail"]
        out.append({"type": "image_url", "image_url": image})
    return out


def _function_call(item: dict[str, Any], where: str, out: list[dict[str, Any]]) -> None:
    call = {
        "id": _string(item, "call_id", where),
        "type": "function",
        "function": {"name": _string(item, "name", where), "arguments": item.get("arguments")},
    }
    if not isinstance(call["function"]["arguments"], str):  # type: ignore[index]
        raise ApiError(400, f"{where}.arguments must be a JSON string", param="input")
    if out and out[-1]["role"] == "assistant":  # the text and calls of one turn: one message
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _function_output(
    item: dict[str, Any], where: str, before: list[dict[str, Any]]
) -> dict[str, Any]:
    call_id = _string(item, "call_id", where)
    names = {c["id"]: c["function"]["name"] for m in before for c in m.get("tool_calls") or [] if c}
    message = {
        "role": "tool",
        "tool_call_id": call_id,
        "content": _text(item.get("output"), f"{where}.output"),
    }
    if call_id in names:
        message["name"] = names[call_id]
    return message


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's `{"type": "function", "function": {...}}`."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ApiError(
                400,
                f"tools[{i}].type {tool.get('type')!r} is not supported: pdserve serves function "
                "tools (the client runs them); built-in tools need OpenAI's servers",
                param="tools",
            )
        keys = ("name", "description", "parameters")
        out.append({"type": "function", "function": {k: tool[k] for k in keys if k in tool}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            400,
            'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": name}}


def response_format(fmt: TextFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise ApiError(400, "text.format.schema is required for json_schema", param="text.format")
    schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": schema}


def chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]], extra: dict[str, Any]
) -> ChatCompletionRequest:
    """The chat request `req` runs as, after `history` (the previous responses' turns)."""
    bad = req.unsupported_fields()
    if bad:
        raise ApiError(400, f"not supported by pdserve: {', '.join(bad)}", param=bad[0])
    system = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": [*system, *history, *input_messages(req.input, history)],
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "user": req.user,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format(req.text.format if req.text else None),
        **{k: extra[k] for k in _PASSED_ON if k in extra},
    }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}
        )
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"input: {where}: {first['msg']}", param="input") from None


CHAT_TO_RESPONSES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)


def responses_error(e: ApiError) -> ApiError:
    """A chat-path error with the fields named as the Responses client spelled them."""
    message, param = e.message, e.param
    for chat, ours in CHAT_TO_RESPONSES:
        message = message.replace(chat, ours)
        param = None if param is None else param.replace(chat, ours)
    return ApiError(e.status, message, param=param, code=e.code, headers=e.headers)
