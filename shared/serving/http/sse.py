"""Server-sent events for streamed completions: `data: {json}\\n\\n` per chunk, `data: [DONE]`
last. With `include_usage` one final chunk with empty `choices` carries the usage; an error after
the stream began is a final `data: {"error": ...}` event, then `[DONE]`."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from shared.serving.grpc_server import GenerateError
from shared.serving.http.errors import ApiError, from_generate_error
from shared.serving.http.render import Renderer
from shared.serving.http.service import Piece, usage_of

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
# pdserve's proxy (pdserve/http_resume.py) sends this header to have each chunk's choice name
# the token ids it covers, in this field, which the proxy removes before its client sees it
TOKEN_IDS_HEADER = "x-pdserve-token-ids"
TOKEN_IDS_FIELD = "pdserve_token_ids"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ChunkWriter:
    """Builds one request's chunks (completion or chat), tracking running usage per choice."""

    def __init__(
        self,
        rid: str,
        model: str,
        created: int,
        renderer: Renderer,
        *,
        usage: bool,
        continuous: bool,
        token_ids: bool = False,
    ) -> None:
        self.renderer = renderer
        # pdserve's proxy asks (TOKEN_IDS_HEADER): each piece's chunk names its tokens
        self.token_ids = token_ids
        self.chat = renderer.rendering.chat
        self.usage, self.continuous = usage, continuous
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        self.last: dict[int, Piece] = {}
        # every chunk starts the same: serialise that part once, not once per token
        head = {"id": rid, "object": self.object, "created": created, "model": model}
        self._head = b"data: " + json.dumps(head, separators=(",", ":"))[:-1].encode()

    def _chunk(self, choices: list[dict[str, Any]], usage: bool = False) -> bytes:
        tail: dict[str, Any] = {"choices": choices}
        if usage or (self.continuous and choices):
            tail["usage"] = usage_of(self.last).model_dump()
        return self._head + b"," + json.dumps(tail, separators=(",", ":"))[1:].encode() + b"\n\n"

    def piece(self, piece: Piece) -> bytes:
        first = piece.index not in self.last
        self.last[piece.index] = piece
        shown = self.renderer.render(piece)
        out = b""
        if self.chat:
            if first:  # OpenAI's first chat chunk names the role
                role = {"role": "assistant", "content": ""}
                out += self._chunk([self._choice(piece.index, role, None, None)])
            body: dict[str, Any] = {"content": shown.text} if shown.text else {}
            if shown.function_call:  # the deprecated `functions`' shape, instead of tool_calls
                body["function_call"] = shown.function_call
            elif shown.tool_calls:
                body["tool_calls"] = shown.tool_calls
            choice = self._choice(piece.index, body, shown.logprobs, shown.finish_reason)
        else:
            choice = {
                "index": piece.index,
                "text": shown.text,
                "logprobs": shown.logprobs,
                "finish_reason": piece.finish_reason,
            }
            if shown.prompt_logprobs is not None:
                choice["prompt_logprobs"] = shown.prompt_logprobs
        if self.token_ids:
            choice[TOKEN_IDS_FIELD] = list(piece.token_ids)
        return out + self._chunk([choice])

    @staticmethod
    def _choice(
        index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish: str | None
    ) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def final(self) -> bytes:
        if not self.usage:
            return b""
        return self._chunk([], usage=True)


async def sse_stream(
    first: Piece, rest: AsyncIterator[Piece], writer: ChunkWriter
) -> AsyncIterator[bytes]:
    """The response body; closing it (client gone) closes `rest`, which releases the requests."""
    async with contextlib.aclosing(rest):  # type: ignore[type-var]
        try:
            yield writer.piece(first)
            async for piece in rest:
                yield writer.piece(piece)
            tail = writer.final()
            if tail:
                yield tail
        except ApiError as e:
            yield e.sse_event()
        except GenerateError as e:
            yield from_generate_error(e).sse_event()
        except Exception:
            log.exception("stream failed")
            yield ApiError(500, "internal error while streaming").sse_event()
        yield DONE
