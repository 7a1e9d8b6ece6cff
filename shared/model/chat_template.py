"""Chat templates rendered the way transformers' `apply_chat_template` renders them.

The template is the model's own Jinja2 text (`chat_template.jinja`, `tokenizer_config.json`'s
`chat_template`, or GGUF's `tokenizer.chat_template`). It runs in jinja2's sandbox with the same
environment options and globals transformers uses, so a rendered prompt is the same string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext  # `import jinja2` alone leaves jinja2.ext (loopcontrols) unloaded
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template could not be rendered (it raised, or the messages do not fit it)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: jinja2's own sorts keys and escapes HTML, so tools and tool-call
    # arguments would render differently
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env.from_string(source)


# the variables `render` itself passes; a caller's extra variables may not replace them
RESERVED_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        try:
            return _compile(self.source).render(
                messages=list(messages),
                tools=None if tools is None else list(tools),  # transformers passes None
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
