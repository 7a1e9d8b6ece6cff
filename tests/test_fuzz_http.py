"""Schemathesis against a live decode node's HTTP API (1 prefill + 1 decode, tiny model).

Cases come from the OpenAPI schema FastAPI builds for the app (the node serves no /openapi.json;
the test asks the app for it). Properties, after every case: the status is one the API documents
(200, 400, 401, 404, 413, 429, 503, 504; never a 500 or FastAPI's default 422), every error is an
OpenAI error object, every seat and block is back in its pool, and the node still serves correct
greedy output. PDSERVE_FUZZ_EXAMPLES sets the examples per operation (60 by default).

Skipped until the HTTP API (shared/serving/http) is on this branch.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest

if importlib.util.find_spec("shared.serving.http") is None:
    pytest.skip("the HTTP API (shared/serving/http) is not on this branch", allow_module_level=True)
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from tests.fuzz_loop import LiveHttp, text_with_a_lone_surrogate  # noqa: E402

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "60"))
DOCUMENTED = {200, 400, 401, 404, 413, 429, 503, 504}


class FuzzedHttp(LiveHttp):
    def openapi(self) -> dict[str, Any]:
        """The schema FastAPI derives from the app's routes and pydantic models."""
        create_app = importlib.import_module("shared.serving.http").create_app
        node = self.cluster.decodes[0]
        app = create_app(node, node.config.http_api(node.core.loaded), CollectorRegistry())
        return app.openapi()


@pytest.fixture(scope="module")
def http_live(checkpoint: Any) -> Iterator[FuzzedHttp]:
    node = FuzzedHttp(checkpoint("llama"))
    yield node
    node.close()


@pytest.fixture(scope="module")
def cases(http_live: FuzzedHttp) -> st.SearchStrategy[Any]:
    """Cases for every operation in the schema: ones that fit it and ones that do not."""
    schema = schemathesis.openapi.from_dict(http_live.openapi())
    schema.config.update(base_url=http_live.url)
    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    return st.one_of(*(schema.as_strategy(mode) for mode in modes))


# schemathesis' own @schema.parametrize / from_fixture do not run under pytest 9 (they set
# Function._nodeid), so its strategies drive a plain hypothesis test
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_generated_http_requests_get_documented_statuses(
    data: st.DataObject, cases: st.SearchStrategy[Any], http_live: FuzzedHttp
) -> None:
    case = data.draw(cases)
    if isinstance(case.body, dict) and "model" in case.body and data.draw(st.booleans()):
        case.body["model"] = http_live.model  # get past the 404 into the engine, often
    response = case.call(base_url=http_live.url, timeout=30)
    event(f"{case.method} {case.path} -> {response.status_code}")
    assert response.status_code in DOCUMENTED, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"], error
    http_live.runner.run(http_live.still_serving())


# ---- strings that are valid JSON but not Unicode text ----------------------------------------
def _bodies(model: str) -> dict[str, dict[str, Any]]:
    """A valid body per endpoint, with strings in every kind of place (top level, lists,
    nested objects)."""
    user = {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"}
    return {
        "/v1/completions": {"model": model, "prompt": ["Hello", "there"], "stop": ["x", "y"]},
        "/v1/chat/completions": {
            "model": model,
            "messages": [{"role": "system", "content": "be brief"}, user],
            "chat_template_kwargs": {"style": "terse"},
            "user": "someone",
        },
        "/tokenize": {"model": model, "prompt": "Hello"},
        "/detokenize": {"model": model, "tokens": [5, 6]},
    }


def _string_paths(value: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(value, str):
        return [path]
    if not isinstance(value, dict | list):
        return []
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return [p for key, item in items for p in _string_paths(item, (*path, str(key)))]


def _replace(value: Any, path: tuple[str, ...], new: str) -> None:
    for key in path[:-1]:
        value = value[int(key) if isinstance(value, list) else key]
    last = path[-1]
    value[int(last) if isinstance(value, list) else last] = new


@settings(
    max_examples=max(10, EXAMPLES // 3),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_lone_surrogates_anywhere_are_400_naming_the_field(
    data: st.DataObject, http_live: FuzzedHttp
) -> None:
    path, body = data.draw(st.sampled_from(sorted(_bodies(http_live.model).items())))
    body["stream"] = data.draw(st.booleans())
    spot = data.draw(st.sampled_from([*_string_paths(body), ("an_unknown_field",)]))
    bad = data.draw(text_with_a_lone_surrogate())
    if spot == ("an_unknown_field",):
        body["an_unknown_field"] = bad
    else:
        _replace(body, spot, bad)
    event(f"{path} {'.'.join(spot)}")
    resp = http_live.post(path, body)
    assert resp.status_code == 400, (path, body, resp.text[:500])
    assert resp.json()["error"]["param"] == ".".join(spot), resp.text[:500]
    http_live.runner.run(http_live.still_serving())
