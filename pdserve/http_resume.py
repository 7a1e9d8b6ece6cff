"""What the proxy keeps of one HTTP completion so that another decode node can finish it.

The HTTP twin of pdserve/stream_resume.py. A streamed POST /v1/completions or
/v1/chat/completions (one answer: n = 1, one prompt, no tools) is sent
with TOKEN_IDS_HEADER, so that each chunk names the tokens it covers; the proxy keeps them and
removes the field. When the node is lost mid-stream (its connection reset or closed before
`data: [DONE]`) another node is asked for the rest: the same body with `pdserve_continuation`
set to the tokens sent, which that node treats as the answer's first tokens (prompt, max_tokens,
min_tokens, seeded draws at their output index, and the text they released: the rest of the
text follows it exactly). The client sees one stream: the first call's `id` and `created`, one
role announcement (chat), logprobs' `text_offset` running on, and usage that counts the prompt
as sent and the whole answer. A request whose node is lost before it answered is sent whole to
another node. docs/deployment.md ("The front door and streams that survive their node").
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from shared.serving.http.errors import ApiError
from shared.serving.http.sse import DONE, TOKEN_IDS_FIELD, TOKEN_IDS_HEADER

log = logging.getLogger("pdserve.proxy")

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
CONTINUATION_FIELD = "pdserve_continuation"  # shared/serving/http/schemas.py
TIMEOUT_HEADER = "x-request-timeout"
SEP = b"\n\n"
# request fields whose state on the node a continuation would not carry (a tool parser reads
# the whole answer): a request setting any of them is not resumed. A grammar's state is: the
# node advances it over the continued tokens (shared/engine/sampling/grammar_rows.py)
_STATEFUL = ("tools", "functions")
_ROLE = {"role": "assistant", "content": ""}  # chat's first chunk: the node's, once per answer


def ledger_for(method: str, path: str, body: bytes, timeout: str | None) -> HttpLedger | None:
    """The ledger of a request another node could finish, if it is one (`timeout`: its
    X-Request-Timeout header)."""
    if method != "POST" or path not in (COMPLETIONS_PATH, CHAT_PATH):
        return None
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None  # malformed: the node answers the 400
    if not isinstance(request, dict) or not _one_plain_answer(request, path == CHAT_PATH):
        return None
    return HttpLedger(path == CHAT_PATH, request, _deadline(timeout))


def _one_plain_answer(request: dict[str, Any], chat: bool) -> bool:
    if request.get("n") not in (None, 1) or request.get("best_of") not in (None, 1):
        return False
    if any(request.get(name) not in (None, [], {}) for name in _STATEFUL):
        return False
    prompt = request.get("prompt")
    # a batch of prompts is several answers
    return chat or not (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int))


def _deadline(timeout: str | None) -> float | None:
    try:
        seconds = float(timeout) if timeout is not None else 0.0
    except ValueError:
        return None  # the node answers the 400
    return time.monotonic() + seconds if seconds > 0 else None


class HttpLedger:
    """One completion's request and what its client was sent so far."""

    def __init__(self, chat: bool, request: dict[str, Any], deadline: float | None) -> None:
        self.chat, self.request, self.deadline = chat, request, deadline
        self.stream = request.get("stream") is True
        own = request.get(CONTINUATION_FIELD)  # one the client sent itself
        self.own: list[int] = list(own) if isinstance(own, list) else []
        self.sent: list[int] = []  # tokens of the chunks passed on to the client
        self.added = 0  # tokens of `sent` the current call got as continuation
        self.resumes = 0
        self.id: object = None  # the first call's chunk id and creation time
        self.created: object = None
        self.role_sent = False
        self.offset = 0  # completions' logprobs: the text_offset of the next token
        self.base = 0  # what the current call's text_offsets start after
        self.finished = False  # a finish_reason was passed on: nothing left to generate
        self.ended = False  # the node's own error event was passed on
        self.done = False  # `data: [DONE]` was passed on

    @property
    def resumable(self) -> bool:
        left = self.request.get("max_completion_tokens", self.request.get("max_tokens"))
        room = not isinstance(left, int) or left - len(self.own) - len(self.sent) >= 1
        return not (self.finished or self.ended or self.done) and room

    def remaining(self) -> float | None:
        """Seconds left of the client's X-Request-Timeout (None: none given)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def headers(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The headers of the next call: the deadline's remaining time, the token ids asked."""
        out = [(k, v) for k, v in headers if k.lower() not in (TIMEOUT_HEADER, TOKEN_IDS_HEADER)]
        left = self.remaining()
        if left is not None:
            out.append((TIMEOUT_HEADER, f"{max(left, 0.001):.3f}"))
        if self.stream:
            out.append((TOKEN_IDS_HEADER, "1"))
        return out

    def continuation(self) -> bytes:
        """The body that asks another node for the rest of the answer."""
        body = dict(self.request)
        body[CONTINUATION_FIELD] = [*self.own, *self.sent]
        if not self.chat:  # the first call showed the prompt already
            body["echo"] = False
            body.pop("prompt_logprobs", None)
        self.added, self.base = len(self.sent), self.offset
        self.resumes += 1
        return json.dumps(body).encode()

    def record(self, event: bytes) -> bytes:
        """Note one event (without its blank line) the client is about to get; returns it as
        the client should see it, blank line included (b"": not at all)."""
        data = event.removeprefix(b"data: ")
        if data == event:
            return event + SEP
        if data == b"[DONE]":
            self.done = True
            return event + SEP
        try:
            chunk = json.loads(data)
        except ValueError:
            return event + SEP
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
            self.ended = True  # an error event: the node's answer, passed on as it came
            return event + SEP
        if self.id is None:
            self.id, self.created = chunk.get("id"), chunk.get("created")
        if not self._keep(chunk["choices"]):
            return b""
        if self.resumes:
            chunk["id"], chunk["created"] = self.id, self.created
            self._fix_usage(chunk.get("usage"))
        # json.dumps as the node writes it (shared/serving/http/sse.py): unchanged chunks keep
        # their bytes
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + SEP

    def _keep(self, choices: list[Any]) -> bool:
        """Record the chunk's choices; False: a second role announcement, dropped."""
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            ids = choice.pop(TOKEN_IDS_FIELD, [])
            self.sent.extend(ids)
            if choice.get("finish_reason") is not None:
                self.finished = True
            if self.chat and not ids and choice.get("delta") == _ROLE:
                if self.role_sent:
                    return False
                self.role_sent = True
            elif not self.chat:
                self._shift_offsets(choice.get("logprobs"))
        return True

    def _shift_offsets(self, logprobs: object) -> None:
        """Completions' text_offset counts from the answer's start, not the current call's."""
        if not isinstance(logprobs, dict):
            return
        offsets, tokens = logprobs.get("text_offset"), logprobs.get("tokens")
        if not offsets or not isinstance(offsets, list) or not isinstance(tokens, list):
            return
        offsets[:] = [o + self.base for o in offsets]
        self.offset = offsets[-1] + len(tokens[-1])

    def _fix_usage(self, usage: object) -> None:
        """The continuation is answer, not prompt."""
        if not isinstance(usage, dict) or not self.added:
            return
        usage["prompt_tokens"] -= self.added
        usage["completion_tokens"] += self.added
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            details["cached_tokens"] = min(details["cached_tokens"], usage["prompt_tokens"])


@dataclass
class Upstream:
    """A call to a replica that answered: the replica, its response, and the route taken."""

    target: str
    response: httpx.Response
    release: Callable[[], None]
    closed: bool = False

    async def close(self) -> None:
        """Release the route and close the response, once, whoever asks first."""
        if self.closed:
            return
        self.closed = True
        self.release()
        await self.response.aclose()


class ResumingStream:
    """One resumable stream's body: the current node's events through the ledger; when that
    node is lost, the rest from another (`reopen`: the continuation to a healthy replica other
    than the lost one), up to `max_resumes` times. Every exit (done, error, client gone) closes
    the current call."""

    def __init__(
        self,
        ledger: HttpLedger,
        first: Upstream,
        *,
        max_resumes: int,
        reopen: Callable[[str, bytes], Awaitable[Upstream | None]],
        outcome: Callable[[str], None],
    ) -> None:
        self.ledger, self.current, self.max_resumes = ledger, first, max_resumes
        self.reopen, self.outcome = reopen, outcome
        self.failure: str | None = None

    async def body(self) -> AsyncIterator[bytes]:
        try:
            while True:
                async for out in self._relay():
                    yield out
                if self.failure is None:
                    if self.ledger.resumes:
                        self.outcome("completed")
                    return
                last = await self._resume()
                if last is not None:
                    yield last + DONE
                    return
        finally:
            await self.current.close()

    async def _relay(self) -> AsyncIterator[bytes]:
        """The current call's events, each whole, as the ledger passes them on; `failure`
        says why the call ended early (None: it ended with [DONE])."""
        self.failure, buffer = None, b""
        try:
            async for raw in self.current.response.aiter_raw():
                *events, buffer = (buffer + raw).split(SEP)
                for event in events:
                    out = self.ledger.record(event)
                    if out:
                        yield out
        except httpx.HTTPError as e:
            self.failure = repr(e)
            return
        if not self.ledger.done:
            self.failure = "the connection closed before data: [DONE]"

    async def _resume(self) -> bytes | None:
        """Move the stream to another node: None once one answers; else the error event that
        ends the stream (without [DONE])."""
        ledger, lost = self.ledger, self.current.target
        why = f"decode node {lost} failed mid-stream ({self.failure})"
        log.warning("HTTP stream on %s lost after %d tokens: %s", lost, len(ledger.sent), why)
        if not ledger.resumable:
            return ApiError(503, why).sse_event()
        if ledger.resumes >= self.max_resumes:
            self.outcome("failed")
            return ApiError(
                503,
                f"{why} and the stream was resumed {ledger.resumes} time(s) already "
                f"(--max-resumes {self.max_resumes})",
            ).sse_event()
        left = ledger.remaining()
        if left is not None and left <= 0:
            self.outcome("failed")
            return ApiError(504, f"{why} and the request's deadline passed").sse_event()
        await self.current.close()
        opened = await self.reopen(lost, ledger.continuation())
        if opened is None:
            self.outcome("failed")
            return ApiError(503, f"{why} and no other decode node could take it").sse_event()
        self.current = opened
        if opened.response.status_code != 200:  # the survivor's refusal: an error object
            self.outcome("failed")
            content = await opened.response.aread()
            return b"data: " + content.strip() + SEP
        return None
