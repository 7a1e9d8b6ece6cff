"""How each StructuredOutput kind compiles with xgrammar, and how a spec that does not compile is
refused. Light on purpose: the compile workers (grammar_worker.py) import it in a fresh process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from types import ModuleType
from typing import TYPE_CHECKING

from shared.engine.errors import RequestRejected, ResourcesExhausted
from shared.engine.sampling.structured_output import StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr


class GrammarError(RequestRejected):
    """The spec does not compile (INVALID_ARGUMENT / 400); `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class GrammarBusy(ResourcesExhausted):
    """The spec may be fine, but the node cannot compile or hold it now: every compile slot
    stayed taken until the request's deadline, or the grammars in use fill the byte budget
    (RESOURCE_EXHAUSTED / 429 with Retry-After)."""


def field_of(spec: StructuredOutput) -> str:
    return f"sampling.structured ({spec.kind})"


BACKEND_ENV = "PDSERVE_GRAMMAR_BACKEND"  # xgrammar | llguidance: forces one


def backend() -> str:
    """The grammar library this node compiles with: xgrammar where the `structured` extra is
    installed (its masks are precomputed per grammar: faster steps for large grammars), else
    llguidance, a default dependency; PDSERVE_GRAMMAR_BACKEND picks one."""
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced in ("xgrammar", "llguidance"):
        return forced
    if forced:
        raise GrammarError(
            "sampling.structured", f"{BACKEND_ENV}={forced!r}: use xgrammar or llguidance"
        )
    # found, not imported: importing xgrammar takes seconds (transformers, triton) and this runs
    # on the event loop; its compile workers import it where it is used
    return "xgrammar" if importlib.util.find_spec("xgrammar") is not None else "llguidance"


def xgrammar() -> ModuleType:
    """xgrammar, imported on first use: it is the optional `structured` extra (it brings
    transformers and triton, which nothing else on a CPU node needs)."""
    try:
        import xgrammar as module
    except ImportError:
        raise GrammarError(
            "sampling.structured",
            "structured outputs need xgrammar, which this server does not have: "
            "pip install 'pdserve[structured]'",
        ) from None
    return module


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredOutput) -> xgr.CompiledGrammar:
    """`spec` compiled by `compiler`; GrammarError when xgrammar refuses it."""
    try:
        if spec.kind == "json_schema":
            # one space after `:` and `,`, no other whitespace: a weak model cannot spend its
            # tokens on newlines, and the text is what json.dumps writes
            return compiler.compile_json_schema(spec.spec, any_whitespace=False)
        if spec.kind == "json_object":
            # OpenAI's json_object is an object (xgrammar's builtin JSON is any value)
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.spec)
        if spec.kind == "choice":
            return compiler.compile_regex(choice_regex(spec.spec))
        return compiler.compile_grammar(spec.spec)
    except GrammarError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own kinds
        raise GrammarError(field_of(spec), f"invalid {spec.kind}: {_reason(e)}") from None


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location and check boilerplate."""
    lines = str(e).strip().splitlines()
    text = _LOCATION.sub("", lines[0] if lines else type(e).__name__)
    return text.replace("Check failed: (error.empty()) is false: ", "")[:500]


_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def choice_regex(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarError("sampling.structured (choice)", f"not a JSON array: {e}") from None
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        raise GrammarError(
            "sampling.structured (choice)", "choice must be a non-empty list of strings"
        )
    return "|".join(f"({_escape(c)})" for c in choices)


def _escape(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/-" else c for c in text)
