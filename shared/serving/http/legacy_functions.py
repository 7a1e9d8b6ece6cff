"""OpenAI's deprecated function calling: a request with `functions` (and `function_call`: "none",
"auto" or {"name": ...}) is tool calling's (tools.py makes each function a tool and
`function_call` the tool choice: the named function's grammar, "auto"'s parser); only the answer
has the old shape. It shows a choice's first call (the old API has one call per answer) as
`message.function_call` {name, arguments: a JSON string}, streamed as `delta.function_call` (the
name with the first piece of the arguments, then the rest of them in pieces), with finish_reason
`function_call` where tool calling says `tool_calls`.
"""

from __future__ import annotations

from typing import Any

from shared.serving.http.schemas import FunctionCall
from shared.serving.http.tool_parsers import merge_calls

FINISH = "function_call"


def function_call_delta(deltas: list[dict[str, Any]]) -> dict[str, str] | None:
    """A piece's deltas of the one call (OpenAI's tool-call deltas, tool_parsers.py) as its
    `delta.function_call`: the name where the call starts, and the argument fragments."""
    if not deltas:
        return None
    functions = [d["function"] for d in deltas]
    out = {"arguments": "".join(f["arguments"] for f in functions)}
    name = next((f["name"] for f in functions if "name" in f), None)
    return out if name is None else {"name": name, **out}


def function_call(calls: list[dict[str, Any]]) -> FunctionCall | None:
    """A whole answer's `message.function_call`: its first call."""
    merged = merge_calls(calls)
    return FunctionCall.model_validate(merged[0]["function"]) if merged else None
