"""What each piece of a choice shows the client: its text (the prompt first when echoing), its
logprobs in the endpoint's shape, and vLLM's prompt_logprobs. One renderer per request, used
alike by the whole response and the SSE chunks, so that streamed and whole answers agree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.engine.logprobs import TokenLogprobs
from shared.serving.http.logprobs import (
    CompletionLogprobsWriter,
    TokenTexts,
    chat_content,
    prompt_logprobs_shape,
)
from shared.serving.http.schemas import ChatCompletionRequest, CompletionRequest
from shared.serving.http.service import Job, Piece


@dataclass(frozen=True)
class Rendering:
    chat: bool
    logprobs: int | None = None  # alternatives per generated token; None: no logprobs
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's field, completions only

    @staticmethod
    def of(req: CompletionRequest | ChatCompletionRequest) -> Rendering:
        if isinstance(req, ChatCompletionRequest):
            return Rendering(chat=True, logprobs=req.generated_logprobs)
        return Rendering(
            chat=False, logprobs=req.logprobs, echo=req.echo, prompt_logprobs=req.prompt_logprobs
        )


@dataclass
class Rendered:
    text: str
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: list[Any] | None = None


class Renderer:
    def __init__(self, rendering: Rendering, texts: TokenTexts, jobs: list[Job]) -> None:
        self.rendering, self.texts = rendering, texts
        self.jobs = {job.index: job for job in jobs}
        self.started: set[int] = set()
        self.writers: dict[int, CompletionLogprobsWriter] = {}

    def render(self, piece: Piece) -> Rendered:
        first = piece.index not in self.started
        self.started.add(piece.index)
        r, job = self.rendering, self.jobs[piece.job]
        generated = piece.logprobs or []
        out = Rendered(piece.text)
        if r.chat:
            if r.logprobs is not None:
                out.logprobs = {"content": chat_content(self.texts, generated, r.logprobs)}
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
