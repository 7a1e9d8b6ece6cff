"""Tools for the tool-calling tests: six tools with bounded arguments (so that a small model
finishes every call), and a user message asking for each."""

from __future__ import annotations

from typing import Any

from tests.structured_corpus import NAME, SMALL, obj

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}
    for name, desc, params in [
        ("get_weather", "weather in a city", obj({"city": {"enum": ["Paris", "Rome"]}})),
        ("add", "add two numbers", obj({"a": SMALL, "b": SMALL})),
        ("set_light", "turn a light on or off", obj({"on": {"type": "boolean"}})),
        ("greet", "greet someone", obj({"name": NAME})),
        ("move", "move a point", obj({"to": obj({"x": SMALL, "y": SMALL})})),
        (
            "pick",
            "pick some letters",
            obj(
                {
                    "xs": {
                        "type": "array",
                        "items": {"enum": ["a", "b"]},
                        "minItems": 1,
                        "maxItems": 2,
                    }
                }
            ),
        ),
    ]
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def ask(name: str) -> list[dict[str, Any]]:
    desc = next(t["function"]["description"] for t in TOOLS if t["function"]["name"] == name)
    return [{"role": "user", "content": f"Please {desc}."}]
