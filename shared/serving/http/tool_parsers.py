"""Tool calls parsed out of a model's text as it streams: each parser is fed the text deltas of
one choice and returns the content to show and OpenAI's tool-call deltas (the first delta of a
call carries its index, id, type and name with empty arguments; later ones argument fragments).

`hermes` reads `<tool_call>{json}</tool_call>` blocks (Qwen2.5, Qwen3, Hermes), `llama3_json` a
bare `{"name": ..., "parameters": ...}` object, optionally after `<|python_tag|>`, several joined
by `;` (Llama 3.x), `mistral` a `[TOOL_CALLS]` tag then a JSON list of calls (Mistral, Mixtral,
Mistral Nemo; the tag may have been dropped as a special token). `required` and `named` read
what the tool grammars (tools.py) let any model write. The non-streamed answer is the same
parser fed the same deltas, so both agree.

Written by hand: the streamed deltas must follow the text as it arrives, and a call's arguments
are passed on as the model wrote them (no re-serialisation), which a JSON library does not do.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    index: int  # the call's position in the choice's tool_calls
    arguments: str = ""
    id: str | None = None  # set on a call's first delta, with its name
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class Parsed:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: Parsed) -> Parsed:
        self.content += other.content
        for delta in other.calls:
            last = self.calls[-1] if self.calls else None
            if last and last.index == delta.index and last.id is None and delta.id is None:
                last.arguments += delta.arguments  # one fragment per call per delta
            else:
                self.calls.append(delta)
        return self


def merge_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A choice's streamed deltas as the whole answer's tool_calls."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if "id" in d:
            calls[d["index"]] = {"id": d["id"], "type": "function", "function": dict(d["function"])}
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


class CallScanner:
    """One call's JSON object, fed a character at a time: its `name` string, and its arguments
    (the value of one of `arg_keys`) passed on as written once the name is known. An arguments
    value that is a JSON string (some models encode them) is passed on decoded, when it ends."""

    def __init__(self, index: int, arg_keys: tuple[str, ...]) -> None:
        self.index, self.arg_keys = index, arg_keys
        self.depth, self.in_string, self.escaped = 0, False, False
        self.raw = ""  # the object's text so far (shown as content if it is no call)
        self.key: str | None = None  # the top-level key whose value is being read
        self.token = ""  # a top-level key, or the current value, as written
        self.name: str | None = None
        self.args_seen = False
        self.pending = ""  # arguments written before the name was known, or a string value
        self.started = self.done = False

    def feed(self, ch: str, out: Parsed) -> None:
        self.raw += ch
        before = self.depth
        top = before == 1 and not self.in_string  # a character of the object's own level
        self._track(ch)
        if before == 0:
            pass  # the opening brace
        elif top and self.key is not None and (ch == "," or self.depth == 0):
            self._end_value(out)
        elif top and self.key is None:
            if ch == ":":
                key = _loads(self.token.strip())
                self.key, self.token = key if isinstance(key, str) else "", ""
            elif ch not in ",}":
                self.token += ch
        elif self.key is None:
            self.token += ch  # inside a key's string
        else:
            self._take(ch, out)
        self.done = self.depth == 0 and before > 0

    def _track(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1

    def _take(self, ch: str, out: Parsed) -> None:
        self.token += ch
        if self.key not in self.arg_keys or not self.token.strip():
            return
        self.args_seen = True
        if not self.token.lstrip().startswith('"'):  # a string value is decoded when it ends
            self._emit(ch, out)

    def _end_value(self, out: Parsed) -> None:
        value = self.token.strip()
        if self.key == "name" and isinstance(_loads(value), str):
            self.name = _loads(value)
            self._emit("", out)
        elif self.key in self.arg_keys and value.startswith('"'):
            decoded = _loads(value)
            self._emit(decoded if isinstance(decoded, str) else value, out)
        self.key, self.token = None, ""

    def _emit(self, text: str, out: Parsed) -> None:
        if self.name is None:
            self.pending += text
            return
        if not self.started:
            self.started = True
            out.calls.append(ToolCallDelta(self.index, "", call_id(), self.name))
        text, self.pending = self.pending + text, ""
        if text:
            out.add(Parsed(calls=[ToolCallDelta(self.index, text)]))

    def close(self, out: Parsed) -> bool:
        """At the object's end: whether it was a call (its name found); no arguments is {}."""
        if self.name is None:
            return False
        if not self.args_seen:
            self._emit("{}", out)
        return True


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class ToolParser:
    """Fed one choice's text deltas; `called` once it returned a call. A state machine over
    the text not yet consumed: each state's `_<state>` step consumes some of it, or waits."""

    arg_keys: tuple[str, ...] = ("arguments", "parameters")
    first_state = "text"
    cut_is_content = True  # a call cut before its name: its text is content (free text)

    def __init__(self) -> None:
        self.calls = 0
        self.scanner: CallScanner | None = None
        self.state, self.buffer = self.first_state, ""

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self.buffer += text
        while self.buffer:
            before = (self.state, self.buffer)
            getattr(self, f"_{self.state}")(out)
            if (self.state, self.buffer) == before:
                break  # waiting for more text
        return out

    def finish(self) -> Parsed:
        """At the choice's end: what was held back (a cut call's text is content)."""
        raise NotImplementedError

    def _start_call(self) -> None:
        self.scanner = CallScanner(self.calls, self.arg_keys)

    def _scan(self, ch: str, out: Parsed) -> bool:
        """Feed the open call; True when its object ended (a call, or its text as content)."""
        assert self.scanner is not None
        self.scanner.feed(ch, out)
        if not self.scanner.done:
            return False
        if self.scanner.close(out):
            self.calls += 1
        else:
            out.content += self.scanner.raw
        self.scanner = None
        return True

    def _cut(self, out: Parsed) -> None:
        """The text ended inside a call: a started call stays (cut), otherwise it is content."""
        if self.scanner is not None:
            if self.scanner.started:
                self.calls += 1
            elif self.cut_is_content:
                out.content += self.scanner.raw
            self.scanner = None


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could start `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks amid text."""

    first_state = "text"  # text | open (after <tool_call>) | call | close (after the object)

    def _text(self, out: Parsed) -> None:
        start = self.buffer.find(HERMES_OPEN)
        if start >= 0:
            self._content(self.buffer[:start], out)
            self.state, self.buffer = "open", self.buffer[start + len(HERMES_OPEN) :]
            return
        keep = _held(self.buffer, HERMES_OPEN)
        shown = self.buffer[: len(self.buffer) - keep]
        if shown.strip() or not self.called:
            self._content(shown, out)
            self.buffer = self.buffer[len(shown) :]

    def _content(self, text: str, out: Parsed) -> None:
        if text.strip() or not self.called:  # blank lines between calls are no content
            out.content += text

    def _open(self, out: Parsed) -> None:
        rest = self.buffer.lstrip()
        if not rest:
            return
        if rest[0] != "{":  # no JSON object: the tag was text
            self._content(HERMES_OPEN + self.buffer, out)
            self.state, self.buffer = "text", ""
            return
        self._start_call()
        self.state, self.buffer = "call", rest

    def _call(self, out: Parsed) -> None:
        for i, ch in enumerate(self.buffer):
            if self._scan(ch, out):
                self.state, self.buffer = "close", self.buffer[i + 1 :]
                return
        self.buffer = ""

    def _close(self, out: Parsed) -> None:
        rest = self.buffer.lstrip()
        if rest.startswith(HERMES_CLOSE):
            self.state, self.buffer = "text", rest[len(HERMES_CLOSE) :]
        elif not HERMES_CLOSE.startswith(rest):  # no closing tag: what follows is text
            self.state, self.buffer = "text", rest
        elif rest != self.buffer:
            self.buffer = rest

    def finish(self) -> Parsed:
        out = Parsed()
        self._cut(out)
        if self.state == "open":
            out.content += HERMES_OPEN + self.buffer
        elif self.state == "text" and (self.buffer.strip() or not self.called):
            out.content += self.buffer
        self.buffer = ""
        return out


class Llama3JsonParser(ToolParser):
    """Llama 3.x's JSON calls: the answer is calls only when it starts (after `<|python_tag|>`
    and blanks) with `{`; several are joined by `;`; anything else is content."""

    first_state = "start"  # start | call | between | text

    def _text(self, out: Parsed) -> None:
        out.content, self.buffer = out.content + self.buffer, ""

    def _start(self, out: Parsed) -> None:
        rest = self.buffer.lstrip()
        if rest.startswith(PYTHON_TAG):
            rest = rest[len(PYTHON_TAG) :].lstrip()
        elif rest and PYTHON_TAG.startswith(rest):
            return
        if rest.startswith("{"):
            self._start_call()
            self.state, self.buffer = "call", rest
        elif rest:
            self.state = "text"

    def _call(self, out: Parsed) -> None:
        for i, ch in enumerate(self.buffer):
            if self._scan(ch, out):
                self.state, self.buffer = "between", self.buffer[i + 1 :]
                return
        self.buffer = ""

    def _between(self, out: Parsed) -> None:
        rest = self.buffer.lstrip().lstrip(";").lstrip()
        if rest.startswith("{"):
            self._start_call()
            self.state, self.buffer = "call", rest
        elif rest:
            self.state, self.buffer = "text", rest
        else:
            self.buffer = ""

    def finish(self) -> Parsed:
        out = Parsed()
        self._cut(out)
        if self.state in ("start", "text"):
            out.content += self.buffer
        self.buffer = ""
        return out


class RequiredParser(Llama3JsonParser):
    """What tool_choice "required" lets a model write: `[{"name": ..., "parameters": ...}, ...]`
    (tools.py's grammar), read as calls joined by `, ` inside the brackets."""

    arg_keys = ("parameters",)
    cut_is_content = False  # grammar text, never the model's prose

    def _start(self, out: Parsed) -> None:
        rest = self.buffer.lstrip()
        if rest.startswith("["):
            self.state, self.buffer = "between", rest[1:]

    def _between(self, out: Parsed) -> None:
        rest = self.buffer.lstrip(" ,\n]")
        if rest.startswith("{"):
            self._start_call()
            self.state = "call"
        self.buffer = rest


class MistralParser(RequiredParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`: calls only when the answer starts
    with them; a leading `[{` counts too (the tag is a special token a decoder may drop)."""

    arg_keys = ("arguments",)
    cut_is_content = True  # the model's own text, not a grammar's

    def _start(self, out: Parsed) -> None:
        rest = self.buffer.lstrip()
        if rest.startswith(MISTRAL_TAG):
            rest = rest[len(MISTRAL_TAG) :].lstrip()
        elif MISTRAL_TAG.startswith(rest):
            return  # maybe the tag: wait for more
        after = rest[1:].lstrip()
        if rest.startswith("[") and after.startswith("{"):
            self.state, self.buffer = "between", after
        elif rest and not (rest.startswith("[") and not after):  # "[" alone: wait for more
            self.state = "text"


class NamedParser(ToolParser):
    """A named tool_choice: the whole output is that tool's arguments (tools.py's grammar)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        if not self.called:
            self.calls = 1
            out.calls.append(ToolCallDelta(0, "", call_id(), self.name))
        if text:
            out.add(Parsed(calls=[ToolCallDelta(0, text)]))
        return out

    def finish(self) -> Parsed:
        return self.feed("")


# `--tool-call-parser`: how "auto" tool choice reads calls out of the model's text
TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
