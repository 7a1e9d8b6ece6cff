"""OpenAI's error object and the exception handlers that produce it.

Every failure answers `{"error": {"message", "type", "param", "code"}}` with a precise status:
400 for any validation failure (malformed JSON included: never FastAPI's default 422), 401, 404,
413, 429, 503 with Retry-After, 504. gRPC statuses from the one request path map onto these.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.serving.grpc_server import GenerateError
from shared.serving.http.refusals import count_refusal
from shared.serving.request_outcomes import RequestOutcomes

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout_error",
}

# "sampling.max_tokens must be ..." names the wire field; the HTTP API spells it without prefix
_FIELD_RE = re.compile(r"\bsampling\.(\w+)")
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|.*\[.*\])$")
RETRY_AFTER_SECONDS = "1"
# the API's own routes a 404 lists (health, metrics and docs routes are for operators)
API_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def served_routes(app: FastAPI) -> str:
    """The API routes `app` serves, read from its router so that the list cannot go stale."""
    served = [
        f"{method} {route.path}"
        for route in app.routes
        if isinstance(route, APIRoute) and route.path.startswith(API_PREFIXES)
        for method in sorted(route.methods - {"HEAD"})
    ]
    return ", ".join(served)


class ApiError(Exception):
    """An error answered as OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})
        if status in (429, 503) and "Retry-After" not in self.headers:
            self.headers["Retry-After"] = RETRY_AFTER_SECONDS

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_event(self) -> bytes:
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def from_generate_error(e: GenerateError) -> ApiError:
    status = e.code.http_status
    message = str(e)
    match = _FIELD_RE.search(message)
    param = match.group(1) if match else ("prompt" if "prompt" in message else None)
    message = _FIELD_RE.sub(r"\1", message)
    code = {429: "rate_limit_exceeded", 503: "unavailable", 504: "timeout"}.get(status)
    headers = {} if e.retry_after_s is None else {"Retry-After": str(e.retry_after_s)}
    return ApiError(
        status, message, param=param if status == 400 else None, code=code, headers=headers
    )


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {first.get('msg')}")
    # a union's members appear in loc as type tags ("str", "list[int]"): not fields
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _TYPE_TAG.match(str(p))]
    param = ".".join(loc) or None
    where = f"'{param}'" if param else "the request body"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return ApiError(400, f"{where}: {first.get('msg')}{more}", param=param)


def _routing_error(request: Request, exc: StarletteHTTPException) -> ApiError:
    """Starlette's bare "Not Found" / "Method Not Allowed" as OpenAI's error object, naming
    the route asked for and the ones served (a client of another API learns which it hit);
    FastAPI's "There was an error parsing the body" with its cause."""
    route = f"{request.method} {request.url.path}"
    if isinstance(exc.__cause__, RecursionError):  # Python's JSON parser nests ~1,000 deep
        return ApiError(
            400,
            "the request body nests JSON arrays and objects too deeply to parse (more than "
            f"about {sys.getrecursionlimit()} levels); flatten it, e.g. a schema with $defs "
            "and $ref instead of nesting",
        )
    if exc.status_code == 404 and exc.detail == "Not Found":
        message = f"Invalid URL ({route}): pdserve does not serve this route; it serves "
        return ApiError(404, message + served_routes(request.app), code="unknown_url")
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"Invalid method ({route}): this route takes {allowed or 'another method'}"
        return ApiError(405, message, code="method_not_allowed", headers=exc.headers)
    return ApiError(exc.status_code, str(exc.detail), headers=exc.headers)


def install_error_handlers(app: FastAPI, outcomes: RequestOutcomes | None = None) -> None:
    """The handlers; `outcomes`: where the API's own refusals are counted (refusals.py)."""
    app.state.outcomes = outcomes

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        count_refusal(request.app, exc.status)
        return exc.response()

    @app.exception_handler(GenerateError)
    async def _generate(request: Request, exc: GenerateError) -> JSONResponse:
        return from_generate_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        count_refusal(request.app, 400)
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = _routing_error(request, exc)
        count_refusal(request.app, error.status)
        return error.response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("HTTP request failed")
        return ApiError(500, f"internal error: {type(exc).__name__}").response()
