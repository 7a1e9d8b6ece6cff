"""OpenAI's `response_format` and vLLM's `structured_outputs` / `guided_*` fields, as one
StructuredOutput, with a 400 naming the client's field for what is malformed or ambiguous.

Compiling the grammar (and so judging a schema, regex or grammar) happens in `compile_structured`,
off the engine thread and before anything is queued.
"""

from __future__ import annotations

import json
from typing import Any

from shared.engine.info import EngineInfo
from shared.engine.sampling.grammar_compiler import GrammarBusy, GrammarError, compile_async
from shared.engine.sampling.structured_output import MAX_SPEC_CHARS, StructuredOutput
from shared.serving.http.errors import ApiError
from shared.serving.http.schemas import ChatCompletionRequest, CompletionRequest
from shared.serving.http.tools import tool_grammar

Request = CompletionRequest | ChatCompletionRequest
# vLLM's structured_outputs keys -> StructuredOutput kinds
_VLLM_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def structured_output(req: Request) -> StructuredOutput | None:
    """The request's one constraint (None: free text)."""
    found = [(name, s) for name, s in _candidates(req) if s is not None]
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ApiError(
            400, f"only one structured output may be set, got {names}", param=found[1][0]
        )
    return found[0][1] if found else None


def structured_field(req: Request) -> str:
    """The client's name for the field the constraint came from."""
    return next((name for name, s in _candidates(req) if s is not None), "response_format")


def _candidates(req: Request) -> list[tuple[str, StructuredOutput | None]]:
    out = [("response_format", _response_format(req.response_format))]
    out += _structured_outputs(req.structured_outputs)
    guided = (
        ("guided_json", "json_schema", req.guided_json),
        ("guided_regex", "regex", req.guided_regex),
        ("guided_choice", "choice", req.guided_choice),
        ("guided_grammar", "grammar", req.guided_grammar),
    )
    out += [(name, _spec(name, kind, value)) for name, kind, value in guided]
    if isinstance(req, ChatCompletionRequest):  # tool_choice "required" or named
        out.append(("tools", tool_grammar(req)))
    return out


def _response_format(value: dict[str, Any] | None) -> StructuredOutput | None:
    if value is None or value.get("type") == "text":
        return None
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise ApiError(
            400,
            f"response_format.type must be text, json_object or json_schema, got {kind!r}",
            param="response_format",
        )
    body = value.get("json_schema")
    if not isinstance(body, dict):
        raise ApiError(
            400, "response_format.json_schema must be an object", param="response_format"
        )
    if body.get("schema") is None:  # a json_schema without one would constrain nothing
        raise ApiError(
            400,
            "response_format.json_schema.schema is required with type json_schema (for any "
            'JSON object, use {"type": "json_object"})',
            param="response_format",
        )
    return _spec("response_format.json_schema.schema", "json_schema", body["schema"])


def _structured_outputs(value: Any) -> list[tuple[str, StructuredOutput | None]]:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise ApiError(400, "structured_outputs must be an object", param="structured_outputs")
    out: list[tuple[str, StructuredOutput | None]] = []
    for key, item in value.items():
        name = f"structured_outputs.{key}"
        if key == "json_object":
            out.append((name, StructuredOutput("json_object") if item else None))
        elif key in _VLLM_KEYS:
            out.append((name, _spec(name, _VLLM_KEYS[key], item)))
        elif item is not None:
            raise ApiError(
                400,
                f"{name} is not supported; use json, regex, choice, grammar or json_object",
                param=name,
            )
    return out


def _spec(name: str, kind: str, value: Any) -> StructuredOutput | None:
    if value is None:
        return None
    if kind == "json_schema":
        return _sized(name, "json_schema", json.dumps(_schema(name, value)))
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise ApiError(400, f"{name} must be a non-empty list of strings", param=name)
        return _sized(name, "choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{name} must be a non-empty string", param=name)
    return _sized(name, kind, value)


def _schema(name: str, value: Any) -> dict[str, Any] | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"{name} is not valid JSON: {e}", param=name) from None
        except RecursionError:
            raise ApiError(400, f"{name} nests too deeply to parse", param=name) from None
    if not isinstance(value, dict | bool):
        raise ApiError(400, f"{name} must be a JSON schema object", param=name)
    ref = _remote_ref(value)
    if ref is not None:
        raise ApiError(
            400,
            f"{name}: $ref {ref!r} is not supported: only references within the schema "
            "(#/$defs/...) are; inline the referenced schema",
            param=name,
        )
    return value


def _remote_ref(schema: Any) -> str | None:
    """The first `$ref` that points outside the schema (a URL or another file); walked without
    recursion, so that no nesting depth fails here."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return ref
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _sized(name: str, kind: str, text: str) -> StructuredOutput:
    """The StructuredOutput of `text`, refused here (naming the client's field) when larger
    than the engine takes."""
    if len(text) > MAX_SPEC_CHARS:
        raise ApiError(
            400,
            f"{name} has {len(text)} characters; at most {MAX_SPEC_CHARS} are allowed (e.g. "
            "fewer enum values)",
            param=name,
        )
    return StructuredOutput(kind, text)  # type: ignore[arg-type]


async def compile_structured(req: Request, spec: StructuredOutput | None, info: EngineInfo) -> None:
    """Compile (or find cached) the request's grammar off the engine thread; an invalid one, or
    one that does not compile in time, is a 400 naming the client's field."""
    if spec is None:
        return
    try:
        await compile_async(info.tokenizer, info.vocab_size, spec)
    except GrammarError as e:
        field = structured_field(req)
        raise ApiError(400, f"{field}: {e}", param=field) from None
    except GrammarBusy as e:
        retry = {"Retry-After": str(e.retry_after_s)}
        field = structured_field(req)
        raise ApiError(429, f"{field}: {e}", param=field, headers=retry) from None
