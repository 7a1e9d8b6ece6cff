"""What the HTTP API refuses about a structured output, each a 400 naming the client's field with
what to change: an enum too large for the engine, a schema nested too deeply to parse (in the
body, or in a JSON string), a `$ref` outside the schema, `json_schema` without its schema; and
every one of them counted in `pdserve_requests_total{outcome="invalid_argument"}`. A real
colocated node (tiny) with its HTTP API."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from shared.serving.metrics import parse_prometheus_text
from tests.support.cluster import PdCluster, pd_cluster

pytest.importorskip("xgrammar")


def _fmt(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _deep_schema(depth: int) -> str:
    """A schema nested `depth` objects deep, as JSON text (json.dumps itself recurses)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


class Raw(str):
    """JSON text spliced into the request body as it is."""


def _body(fields: dict[str, Any]) -> str:
    parts = [
        f"{json.dumps(k)}: {v if isinstance(v, Raw) else json.dumps(v)}" for k, v in fields.items()
    ]
    return "{" + ", ".join(parts) + "}"


def _deep() -> Raw:
    return Raw(_body({"name": "x", "schema": Raw(_deep_schema(2000))}))


def _invalid_argument(text: str) -> float:
    values = parse_prometheus_text(text)
    (key,) = (
        k
        for k in values
        if k.startswith("pdserve_requests_total{") and 'outcome="invalid_argument"' in k
    )
    return values[key]


async def _refusals(c: PdCluster) -> None:
    base = f"http://127.0.0.1:{c.decodes[0].http_port}"
    model = c.decodes[0].core.loaded.name
    big_enum = {"enum": [f"value-{i:06d}" for i in range(20000)]}
    # (request fields, the param the 400 names, words its message holds)
    cases: list[tuple[dict[str, Any], str | None, str]] = [
        ({"response_format": _fmt(big_enum)}, "response_format.json_schema.schema", "characters"),
        (
            {"response_format": _fmt({"$ref": "https://example.com/schema.json"})},
            "response_format.json_schema.schema",
            "$ref 'https://example.com/schema.json' is not supported",
        ),
        (
            {"response_format": _fmt({"properties": {"a": {"$ref": "other.json#/x"}}})},
            "response_format.json_schema.schema",
            "only references within the schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "response_format.json_schema.schema is required",
        ),
        (
            {"response_format": Raw(_body({"type": "json_schema", "json_schema": _deep()}))},
            None,
            "nests JSON arrays and objects",
        ),
        (
            {"guided_json": _deep_schema(2000)},
            "guided_json",
            "nests too deeply to parse",
        ),
        ({"response_format": _fmt({"$ref": "#/$defs/missing"})}, "response_format", "invalid"),
    ]
    async with httpx.AsyncClient(timeout=120) as client:
        before = _invalid_argument((await client.get(f"{base}/metrics")).text)
        for fields, param, words in cases:
            body = {"model": model, "prompt": "x", "max_tokens": 4, **fields}
            headers = {"content-type": "application/json"}
            r = await client.post(f"{base}/v1/completions", content=_body(body), headers=headers)
            assert r.status_code == 400, (fields.keys(), r.text[:300])
            error = r.json()["error"]
            assert error["param"] == param, error
            assert words in error["message"], error
            assert "sampling.structured" not in error["message"], error
            assert "There was an error parsing the body" not in error["message"], error
        # a 400 of the request's own schema (no prompt) counts too
        r = await client.post(f"{base}/v1/completions", json={"model": model, "max_tokens": 4})
        assert r.status_code == 400, r.text
        after = _invalid_argument((await client.get(f"{base}/metrics")).text)
    assert after - before == len(cases) + 1


def test_structured_output_refusals_name_the_field_and_are_counted() -> None:
    async def body() -> None:
        async with pd_cluster("tiny", colocated=True, decode_overrides={"http_port": 0}) as c:
            await _refusals(c)
            await c.assert_idle_and_conserved()

    asyncio.run(asyncio.wait_for(body(), 170))
