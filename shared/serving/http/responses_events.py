"""A response's output items built from the chat path's rendered pieces, with the Responses
stream events that say so as they happen.

Text opens an assistant message item, a tool call's first delta a function_call item (closing
whatever item was open), argument fragments extend it. Blank text is held back until it is known
to belong to a message (the blank lines between calls belong to none). The whole (non-streamed)
answer is the same builder with its events dropped, so both always agree.

Events are OpenAI's: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta / .done, response.content_part.done,
response.function_call_arguments.delta / .done, response.output_item.done, then
response.completed (or response.incomplete at max_output_tokens), each numbered in
sequence_number; a failure mid-stream is an `error` event then response.failed.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from shared.serving.http.errors import ApiError
from shared.serving.http.render import Rendered
from shared.serving.http.responses_schemas import (
    FunctionCallItem,
    IncompleteDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from shared.serving.http.schemas import Usage


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: Usage) -> ResponseUsage:
    out = ResponseUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )
    out.input_tokens_details.cached_tokens = usage.prompt_tokens_details.cached_tokens
    return out


class OutputBuilder:
    def __init__(self, response: ResponseObject) -> None:
        self.response = response  # status in_progress, no output yet
        self.open: OutputItem | None = None
        self.blank = ""  # blank text not yet known to be a message's
        self.seq = 0

    @property
    def items(self) -> list[OutputItem]:
        return self.response.output

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        data = json.dumps(body, separators=(",", ":"))  # ASCII: U+2028 splits some readers
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def _snapshot(self) -> dict[str, Any]:
        return self.response.model_dump(mode="json")

    def start(self) -> bytes:
        snapshot = self._snapshot()
        created = self.event("response.created", response=snapshot)
        return created + self.event("response.in_progress", response=snapshot)

    def add(self, shown: Rendered) -> bytes:
        out = self._text(shown.text) if shown.text else b""
        for delta in shown.tool_calls or []:
            out += self._call(delta)
        return out

    def _text(self, text: str) -> bytes:
        out = b""
        if not isinstance(self.open, OutputMessage):
            if not (self.blank + text).strip():
                self.blank += text
                return b""
            text, self.blank = self.blank + text, ""
            out = self._close("completed") + self._open_message()
        message = self.open
        assert isinstance(message, OutputMessage)
        message.content[0].text += text
        at = self._at(message)
        return out + self.event("response.output_text.delta", **at, delta=text, logprobs=[])

    def _open_message(self) -> bytes:
        message = OutputMessage(id=item_id("msg"), status="in_progress")
        out = self._added(message)
        message.content.append(OutputText(text=""))
        part = message.content[0].model_dump()
        return out + self.event("response.content_part.added", **self._at(message), part=part)

    def _call(self, delta: dict[str, Any]) -> bytes:
        function = delta["function"]
        if "id" in delta:  # a new call: its name first, arguments after
            self.blank = ""
            out = self._close("completed")
            call = FunctionCallItem(
                id=item_id("fc"),
                call_id=delta["id"],
                name=function["name"],
                arguments="",
                status="in_progress",
            )
            return out + self._added(call)
        call = self.open
        assert isinstance(call, FunctionCallItem), "arguments before their call"
        call.arguments += function["arguments"]
        kind = "response.function_call_arguments.delta"
        return self.event(kind, **self._at(call), delta=function["arguments"])

    def _added(self, item: OutputItem) -> bytes:
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        return self.event("response.output_item.added", output_index=index, item=item.model_dump())

    def _at(self, item: OutputItem) -> dict[str, Any]:
        at: dict[str, Any] = {"item_id": item.id, "output_index": self.items.index(item)}
        if isinstance(item, OutputMessage):
            at["content_index"] = 0
        return at

    def _close(self, status: str) -> bytes:
        item, self.open = self.open, None
        if item is None:
            return b""
        item.status = status  # type: ignore[assignment]
        at = self._at(item)
        if isinstance(item, OutputMessage):
            part = item.content[0]
            out = self.event("response.output_text.done", **at, text=part.text, logprobs=[])
            out += self.event("response.content_part.done", **at, part=part.model_dump())
        else:
            kind = "response.function_call_arguments.done"
            out = self.event(kind, **at, name=item.name, arguments=item.arguments)
        index, shown = at["output_index"], item.model_dump()
        return out + self.event("response.output_item.done", output_index=index, item=shown)

    def finish(self, finish_reason: str | None, usage: Usage) -> bytes:
        """The last item closed and the response completed (or incomplete: out of tokens)."""
        cut = finish_reason == "length"
        out = b""
        if not self.items:  # nothing but blanks (or nothing): still a message
            out += self._open_message()
            out += self._text(self.blank) if self.blank else b""
        out += self._close("incomplete" if cut else "completed")
        r = self.response
        r.status = "incomplete" if cut else "completed"
        r.incomplete_details = IncompleteDetails(reason="max_output_tokens") if cut else None
        r.usage = response_usage(usage)
        kind = "response.incomplete" if cut else "response.completed"
        return out + self.event(kind, response=self._snapshot())

    def fail(self, error: ApiError) -> bytes:
        code = error.code or str(error.status)
        out = self.event("error", code=code, message=error.message, param=error.param)
        self.response.status = "failed"
        self.response.error = ResponseError(code=code, message=error.message)
        return out + self.event("response.failed", response=self._snapshot())
