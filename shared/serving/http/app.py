"""The OpenAI-compatible HTTP API of a decode node, as a FastAPI app.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET and DELETE
/v1/responses/{id} (responses.py), GET /v1/models[/{model}], vLLM's POST /tokenize, POST
/detokenize and GET /tokenizer_info, GET /health, GET /metrics, GET /version; any other route
is a 404 in OpenAI's error object naming it (errors.py).
Served by uvicorn on the node's own event loop (see shared/serving/metrics.AsgiServer). A client
that goes away — while its stream runs or before its first token — cancels the generation, which
releases the request on both nodes exactly as a gRPC cancel does.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry

from shared.model import attention_choice, native
from shared.serving import tracing
from shared.serving.http.disconnect import ClientGone, until_disconnect
from shared.serving.http.errors import install_error_handlers
from shared.serving.http.guard import ApiGuard
from shared.serving.http.lora_routes import install_lora_routes
from shared.serving.http.refusals import outcomes_of
from shared.serving.http.render import Renderer, Rendering, merge_logprobs
from shared.serving.http.response_store import ResponseStore
from shared.serving.http.responses import install_responses
from shared.serving.http.schemas import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from shared.serving.http.service import (
    Backend,
    HttpApiConfig,
    Job,
    OpenAIService,
    Piece,
    new_id,
    usage_of,
)
from shared.serving.http.shutdown_answer import ShutdownAnswer
from shared.serving.http.sse import SSE_HEADERS, TOKEN_IDS_HEADER, ChunkWriter, sse_stream
from shared.serving.http.structured import compile_structured
from shared.serving.http.tokenization import (
    detokenize,
    parse_tokenize,
    tokenize,
    tokenizer_info,
)
from shared.serving.http.tokenization_schemas import DetokenizeRequest
from shared.serving.http.tool_parsers import ToolParser
from shared.serving.http.tools import assistant_message, tool_parser
from shared.serving.metrics import metrics_routes


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"


def create_app(backend: Backend, config: HttpApiConfig, registry: CollectorRegistry) -> FastAPI:
    service = OpenAIService(backend, config)
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    install_error_handlers(app, outcomes_of(backend))
    app.add_middleware(ApiGuard, api_key=config.api_key, max_request_bytes=config.max_request_bytes)
    app.add_middleware(ShutdownAnswer)  # outermost: a request the drain cuts off gets a 503
    health = metrics_routes(registry, lambda: backend.health[0], lambda: backend.health[1])
    app.router.routes.extend(health)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the connection is gone

    _install_info_routes(app, service, backend)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        service.check_model(body.model)
        jobs = service.jobs(body, service.completion_prompts(body))
        await compile_structured(body, jobs[0].params.structured, backend.info)
        return await _answer(service, request, body, jobs, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        service.check_model(body.model)
        tools = tool_parser(body, service.tool_call_parser)
        prompt = await asyncio.to_thread(service.chat_prompt, body)  # images: CPU work
        jobs = service.jobs(body, [prompt])
        await compile_structured(body, jobs[0].params.structured, backend.info)
        return await _answer(service, request, body, jobs, chat=True, tools=tools)

    store = ResponseStore(config.responses_store_bytes, config.responses_store_entries)
    install_responses(app, service, store)
    if config.runtime_lora:
        install_lora_routes(app, backend, service.model_name)

    _install_tokenizer_routes(app, service)
    return app


def _install_info_routes(app: FastAPI, service: OpenAIService, backend: Backend) -> None:
    """/version and the model cards."""
    version = _version()

    @app.get("/version")
    async def get_version() -> dict[str, object]:
        # each C kernel: on (variant, path) or off and why (shared/model/native.py)
        kernels = {name: state.as_dict() for name, state in native.states().items()}
        info = backend.info  # the pool, what sized it, and the context it serves
        pool = {**info.pool_size.as_dict(), "max_model_len": info.max_model_len}
        # attention's path per kind and the times it was chosen by (attention_choice.py)
        attention = attention_choice.current().as_dict()
        return {"version": version, "kernels": kernels, "attention": attention, "kv_pool": pool}

    @app.get("/v1/models")
    async def list_models() -> dict[str, object]:
        return service.models().model_dump()

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, object]:
        service.check_model(model)  # names may hold slashes (org/name): a path parameter
        return service.model_card().model_dump()


def _install_tokenizer_routes(app: FastAPI, service: OpenAIService) -> None:
    """vLLM's tokenizer routes."""

    @app.post("/tokenize")
    async def tokenize_text(body: dict[str, Any]) -> dict[str, object]:
        # a chat's images are decoded and resized to count their tokens: off the event loop,
        # as the chat route does it
        counted = await asyncio.to_thread(tokenize, service, parse_tokenize(body))
        return counted.model_dump()

    @app.post("/detokenize")
    async def detokenize_ids(body: DetokenizeRequest) -> dict[str, object]:
        return detokenize(service, body).model_dump()

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict[str, object]:
        return tokenizer_info(service).model_dump()


async def _answer(
    service: OpenAIService,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    jobs: list[Job],
    *,
    chat: bool,
    tools: Callable[[], ToolParser] | None = None,
) -> Response:
    rid = new_id("chatcmpl" if chat else "cmpl")
    created = int(time.time())
    deadline = service.deadline(request.headers.get("x-request-timeout"))
    tracing.set_incoming(request.headers)  # the caller's traceparent, for decode.generate
    rendering = replace(Rendering.of(body), tool_parser=tools)
    renderer = Renderer(rendering, service.token_texts, jobs)
    pieces = service.pieces(rid, jobs, deadline)
    if not body.stream:
        collect = _collect(service, rid, created, pieces, renderer, jobs)
        return await until_disconnect(request, collect)
    # the first token is awaited before the headers go out, so that admission errors (429, 503,
    # 400 from the prefill node) keep their HTTP status instead of becoming an SSE error event
    try:
        first = await until_disconnect(request, anext(pieces))
    except BaseException:
        await pieces.aclose()
        raise
    writer = ChunkWriter(
        rid,
        service.model_name,
        created,
        renderer,
        usage=body.include_usage,
        continuous=body.continuous_usage,
        token_ids=request.headers.get(TOKEN_IDS_HEADER) == "1",
    )
    return StreamingResponse(
        sse_stream(first, pieces, writer), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def _collect(
    service: OpenAIService,
    rid: str,
    created: int,
    pieces: AsyncIterator[Piece],
    renderer: Renderer,
    jobs: list[Job],
) -> Response:
    n = sum(job.params.n for job in jobs)
    texts: dict[int, list[str]] = {i: [] for i in range(n)}
    logprobs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(n)}
    prompt_logprobs: dict[int, list[Any] | None] = {}
    tool_calls: dict[int, list[dict[str, Any]]] = {i: [] for i in range(n)}
    finish: dict[int, str | None] = {}
    last: dict[int, Piece] = {}
    async with contextlib.aclosing(pieces):  # type: ignore[type-var]
        async for piece in pieces:
            shown = renderer.render(piece)
            texts[piece.index].append(shown.text)
            if shown.logprobs is not None:
                logprobs[piece.index].append(shown.logprobs)
            if shown.prompt_logprobs is not None:
                prompt_logprobs[piece.index] = shown.prompt_logprobs
            tool_calls[piece.index] += shown.tool_calls or []
            finish[piece.index] = shown.finish_reason
            last[piece.index] = piece
    usage = usage_of(last)
    common = {"id": rid, "created": created, "model": service.model_name, "usage": usage}
    legacy = renderer.rendering.functions  # calls shown as the deprecated function_call
    if renderer.rendering.chat:
        choices = [
            ChatChoice(
                index=i,
                message=assistant_message("".join(texts[i]), tool_calls[i], legacy),
                logprobs=merge_logprobs(True, logprobs[i]),
                finish_reason=finish[i],
            )
            for i in range(n)
        ]
        out: ChatCompletionResponse | CompletionResponse = ChatCompletionResponse(
            choices=choices, **common
        )
    else:
        completions = [
            CompletionChoice(
                index=i,
                text="".join(texts[i]),
                logprobs=merge_logprobs(False, logprobs[i]),
                finish_reason=last[i].finish_reason,
                prompt_logprobs=prompt_logprobs.get(i),
            )
            for i in range(n)
        ]
        out = CompletionResponse(choices=completions, **common)
    return Response(out.model_dump_json(), media_type="application/json")
