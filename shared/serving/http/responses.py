"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed), `GET` and `DELETE
/v1/responses/{id}`.

A Responses request runs as the chat-completions request it translates to (responses_input.py):
the same chat template, tool-call parsing, grammars, sampling and one request path; only the
answer's shape differs (responses_events.py). Stored responses (response_store.py) give
`previous_response_id` its conversation and GET its body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from shared.serving import tracing
from shared.serving.grpc_server import GenerateError
from shared.serving.http.disconnect import until_disconnect
from shared.serving.http.errors import ApiError, from_generate_error
from shared.serving.http.render import Renderer, Rendering
from shared.serving.http.response_store import ResponseStore, StoredResponse, owner_of
from shared.serving.http.responses_events import OutputBuilder, item_id
from shared.serving.http.responses_input import chat_request, input_messages, responses_error
from shared.serving.http.responses_schemas import ResponseObject, ResponsesRequest
from shared.serving.http.schemas import ChatCompletionRequest
from shared.serving.http.service import Job, OpenAIService, Piece, usage_of
from shared.serving.http.sse import SSE_HEADERS
from shared.serving.http.structured import compile_structured
from shared.serving.http.tool_parsers import ToolParser
from shared.serving.http.tools import tool_parser

log = logging.getLogger(__name__)
NOT_FOUND = "response_not_found"


@dataclass
class Turn:
    """One Responses request, ready to run."""

    request: ResponsesRequest
    chat: ChatCompletionRequest
    owner: str
    history: list[dict[str, Any]]  # the previous responses' messages (instructions aside)
    jobs: list[Job]
    tools: Callable[[], ToolParser] | None


def install_responses(app: FastAPI, service: OpenAIService, store: ResponseStore) -> None:
    @app.post("/v1/responses")
    async def create(req: ResponsesRequest, request: Request) -> Response:
        owner = owner_of(request.headers.get("authorization"))
        try:
            turn = await _prepare(service, store, req, owner)
        except ApiError as e:
            raise responses_error(e) from None
        deadline = service.deadline(request.headers.get("x-request-timeout"))
        tracing.set_incoming(request.headers)
        builder = OutputBuilder(_head(service, req))
        rendering = replace(Rendering.of(turn.chat), tool_parser=turn.tools)
        renderer = Renderer(rendering, service.token_texts, turn.jobs)
        pieces = service.pieces(builder.response.id, turn.jobs, deadline)
        if not req.stream:
            run = _run(turn, store, builder, renderer, pieces, None)
            await until_disconnect(request, _drain(run))
            return Response(builder.response.model_dump_json(), media_type="application/json")
        try:  # the first token before the headers: admission errors keep their status
            first = await until_disconnect(request, anext(pieces))
        except BaseException:
            await pieces.aclose()
            raise
        events = _stream(_run(turn, store, builder, renderer, pieces, first), builder)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str, request: Request) -> Response:
        stored = _stored(store, rid, request, "id")
        return Response(stored.body, media_type="application/json")

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str, request: Request) -> dict[str, object]:
        _stored(store, rid, request, "id")
        store.delete(rid, owner_of(request.headers.get("authorization")))
        return {"id": rid, "object": "response.deleted", "deleted": True}


def _stored(store: ResponseStore, rid: str, request: Request, param: str) -> StoredResponse:
    stored = store.get(rid, owner_of(request.headers.get("authorization")))
    if stored is None:
        raise ApiError(
            404,
            f"no stored response {rid!r} on this server (responses made with store: false, "
            "evicted from its bounded memory or made before a restart are gone)",
            param=param,
            code=NOT_FOUND,
        )
    return stored


async def _prepare(
    service: OpenAIService,
    store: ResponseStore,
    req: ResponsesRequest,
    owner: str,
) -> Turn:
    service.check_model(req.model)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = store.get(req.previous_response_id, owner)
        if stored is None:
            raise ApiError(
                404,
                f"previous_response_id {req.previous_response_id!r} is not stored on this "
                "server (store: false, evicted, or made before a restart)",
                param="previous_response_id",
                code=NOT_FOUND,
            )
        history = stored.messages()
    chat = chat_request(req, history, req.model_extra or {})
    tools = tool_parser(chat, service.tool_call_parser)
    prompt = await asyncio.to_thread(service.chat_prompt, chat)  # images: CPU work
    jobs = service.jobs(chat, [prompt])
    await compile_structured(chat, jobs[0].params.structured, service.backend.info)
    return Turn(req, chat, owner, history, jobs, tools)


def _head(service: OpenAIService, req: ResponsesRequest) -> ResponseObject:
    return ResponseObject(
        id=item_id("resp"),
        created_at=int(time.time()),
        status="in_progress",
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        model=service.model_name,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id,
        store=req.store,
        temperature=req.temperature,
        text={"format": (req.text.format.dumped() if req.text else {"type": "text"})},
        tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
        tools=req.tools or [],
        top_p=req.top_p,
        user=req.user,
        metadata=req.metadata or {},
    )


async def _run(
    turn: Turn,
    store: ResponseStore,
    builder: OutputBuilder,
    renderer: Renderer,
    pieces: AsyncIterator[Piece],
    first: Piece | None,
) -> AsyncIterator[bytes]:
    """The response's events, first to last; the response is stored once complete."""
    last: dict[int, Piece] = {}
    finish: str | None = None
    yield builder.start()
    async with contextlib.aclosing(pieces):  # type: ignore[type-var]
        if first is not None:
            pieces = _prepend(first, pieces)
        async for piece in pieces:
            last[piece.index] = piece
            shown = renderer.render(piece)
            finish = shown.finish_reason or finish
            yield builder.add(shown)
    yield builder.finish(finish, usage_of(last))
    if turn.request.store:
        _keep(turn, store, builder)


async def _prepend(first: Piece, rest: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    yield first
    async for piece in rest:
        yield piece


def _keep(turn: Turn, store: ResponseStore, builder: OutputBuilder) -> None:
    response = builder.response
    asked = input_messages(turn.request.input, turn.history)
    said = [item.model_dump() for item in response.output]
    conversation = [*turn.history, *asked]
    conversation += input_messages(said, conversation)
    entry = StoredResponse(
        turn.owner, response.model_dump_json().encode(), json.dumps(conversation).encode()
    )
    store.put(response.id, entry)


async def _drain(events: AsyncIterator[bytes]) -> None:
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        async for _ in events:
            pass


async def _stream(events: AsyncIterator[bytes], builder: OutputBuilder) -> AsyncIterator[bytes]:
    """The SSE body; an error after the stream began is an `error` then `response.failed`."""
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        try:
            async for chunk in events:
                if chunk:
                    yield chunk
        except ApiError as e:
            yield builder.fail(e)
        except GenerateError as e:
            yield builder.fail(from_generate_error(e))
        except Exception:
            log.exception("response stream failed")
            yield builder.fail(ApiError(500, "internal error while streaming"))
