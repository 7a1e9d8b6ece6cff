"""What each piece of a choice shows the client: its text (the prompt first when echoing), its
logprobs in the endpoint's shape, vLLM's prompt_logprobs, and the tool calls read out of the
text (tool_parsers.py) with finish_reason tool_calls (the deprecated `functions`: the first call
as `function_call`, legacy_functions.py). One renderer per request, used
alike by the whole response and the SSE chunks, so that streamed and whole answers agree."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.engine.sampling.logprobs import TokenLogprobs
from shared.serving.http.legacy_functions import FINISH, function_call_delta
from shared.serving.http.logprobs import (
    CompletionLogprobsWriter,
    TokenTexts,
    chat_content,
    prompt_logprobs_shape,
)
from shared.serving.http.schemas import ChatCompletionRequest, CompletionRequest
from shared.serving.http.service import Job, Piece
from shared.serving.http.tool_parsers import ToolParser


@dataclass(frozen=True)
class Rendering:
    chat: bool
    logprobs: int | None = None  # alternatives per generated token; None: no logprobs
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's field, completions only
    tool_parser: Callable[[], ToolParser] | None = None  # chat with tools: one per choice
    functions: bool = False  # tools given as the deprecated `functions`: calls in that shape

    @staticmethod
    def of(req: CompletionRequest | ChatCompletionRequest) -> Rendering:
        if isinstance(req, ChatCompletionRequest):
            return Rendering(
                chat=True, logprobs=req.generated_logprobs, functions=bool(req.functions)
            )
        return Rendering(
            chat=False, logprobs=req.logprobs, echo=req.echo, prompt_logprobs=req.prompt_logprobs
        )


@dataclass
class Rendered:
    text: str
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: list[Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's tool-call deltas
    function_call: dict[str, str] | None = None  # shown instead of tool_calls (`functions`)
    finish_reason: str | None = None


class Renderer:
    def __init__(self, rendering: Rendering, texts: TokenTexts, jobs: list[Job]) -> None:
        self.rendering, self.texts = rendering, texts
        self.jobs = {job.index: job for job in jobs}
        self.started: set[int] = set()
        self.writers: dict[int, CompletionLogprobsWriter] = {}
        self.parsers: dict[int, ToolParser] = {}

    def render(self, piece: Piece) -> Rendered:
        first = piece.index not in self.started
        self.started.add(piece.index)
        r, job = self.rendering, self.jobs[piece.job]
        generated = piece.logprobs or []
        out = Rendered(piece.text, finish_reason=piece.finish_reason)
        if r.chat:
            if r.logprobs is not None:
                out.logprobs = {"content": chat_content(self.texts, generated, r.logprobs)}
            if r.tool_parser is not None:
                self._tool_calls(piece, r.tool_parser, out)
            return out
        entries: list[tuple[int, TokenLogprobs | None]] = [(lp.token_id, lp) for lp in generated]
        if first and r.echo:
            out.text = job.prompt_text + out.text
            prompt = self._prompt_entries(job, piece.prompt_logprobs)
            entries = [*zip(job.prompt, prompt, strict=True), *entries]
        if r.logprobs is not None:
            writer = self.writers.setdefault(
                piece.index, CompletionLogprobsWriter(self.texts, r.logprobs)
            )
            out.logprobs = writer.shape(entries)
        if first and r.prompt_logprobs is not None:
            prompt = self._prompt_entries(job, piece.prompt_logprobs)
            out.prompt_logprobs = prompt_logprobs_shape(
                self.texts, job.prompt, prompt, r.prompt_logprobs
            )
        return out

    def _tool_calls(self, piece: Piece, new: Callable[[], ToolParser], out: Rendered) -> None:
        parser = self.parsers.get(piece.index) or self.parsers.setdefault(piece.index, new())
        parsed = parser.feed(piece.text)
        if piece.finish_reason is not None:
            parsed = parsed.add(parser.finish())
            if parser.called and piece.finish_reason == "stop":
                out.finish_reason = FINISH if self.rendering.functions else "tool_calls"
        out.text = parsed.content
        calls = [d.as_dict() for d in parsed.calls]
        if self.rendering.functions:  # the deprecated shape: one call per answer, the first
            calls = [c for c in calls if c["index"] == 0]
            out.function_call = function_call_delta(calls)
        out.tool_calls = calls or None

    @staticmethod
    def _prompt_entries(
        job: Job, computed: list[TokenLogprobs | None] | None
    ) -> list[TokenLogprobs | None]:
        if computed is None or len(computed) != len(job.prompt):
            return [None] * len(job.prompt)  # not computed (no logprobs asked): none to show
        return computed


def merge_logprobs(chat: bool, parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One choice's pieces' logprobs as the whole response's object."""
    if not parts:
        return None
    if chat:
        return {"content": [entry for part in parts for entry in part["content"]]}
    return {key: [v for part in parts for v in part[key]] for key in parts[0]}
