"""JSON schemas for the structured-output tests: enums, nested objects, arrays with bounds,
integers with ranges, optional fields; every one bounded, so a random model can finish it."""

from __future__ import annotations

from typing import Any

# a pattern, not maxLength: xgrammar 0.2.9 lets raw control characters into a maxLength string
NAME = {"type": "string", "pattern": "^[a-z]{1,4}$"}
SMALL = {"type": "integer", "minimum": 0, "maximum": 9}


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: list[dict[str, Any]] = [
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"n": SMALL}),
    obj({"n": {"type": "integer", "minimum": -20, "maximum": 20}, "ok": {"type": "boolean"}}),
    obj({"name": NAME, "age": {"type": "integer", "minimum": 1, "maximum": 99}}),
    obj({"a": obj({"b": obj({"c": {"enum": [1, 2, 3]}})})}),
    obj({"tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}}),
    obj({"xs": {"type": "array", "items": SMALL, "minItems": 1, "maxItems": 3}}),
    obj({"id": SMALL, "note": NAME}, required=["id"]),
    obj({"kind": {"const": "point"}, "x": SMALL, "y": SMALL}),
    obj({"v": {"anyOf": [SMALL, {"type": "null"}]}}),
    obj({"pairs": {"type": "array", "items": obj({"k": NAME}), "maxItems": 2}}),
    obj({"flag": {"type": "boolean"}, "level": {"enum": ["low", "high"]}}, required=["level"]),
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 4},
    {"enum": ["yes", "no", "maybe"]},
]
