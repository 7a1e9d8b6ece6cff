"""Every string in a request body must be Unicode text: no lone surrogates.

JSON may spell a UTF-16 surrogate on its own (`"\\ud800"`): the body is valid JSON, and Python's
parser returns a str that holds the surrogate. Such a str cannot be encoded as UTF-8, so the
tokenizer, a chat template or the JSON answer that echoes it would fail deep inside the request
path (a 500). It is refused here instead, with a 400 naming the field, before the body is parsed
for the route. A surrogate can only arrive as a `\\uD800`-`\\uDFFF` escape (raw UTF-8 bytes cannot
encode one, and bad bytes fail JSON parsing itself), so bodies without such an escape, nearly
all, skip the walk.
"""

from __future__ import annotations

import json
import re
from typing import Any

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def lone_surrogate(body: bytes) -> tuple[str, str] | None:
    """(the field's path, what is wrong) for the first string in the JSON `body` that is not
    Unicode text; None when every string is, or when the body is not JSON (the route says so)."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _walk(value, "")


def _walk(value: Any, path: str) -> tuple[str, str] | None:
    if isinstance(value, str):
        return _check(value, path)
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _walk(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            where = path or "the request body"
            bad_key = _check(key, where)
            if bad_key:
                return where, f"a key in {where} {bad_key[1]}"
            found = _walk(item, f"{path}.{key}" if path else key)
            if found:
                return found
    return None


def _check(text: str, path: str) -> tuple[str, str] | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        point = ord(text[e.start])
        return path, f"holds a lone surrogate (U+{point:04X} at index {e.start}): not Unicode text"
    return None
