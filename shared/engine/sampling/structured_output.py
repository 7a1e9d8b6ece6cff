"""What a structured-output request asks for: a grammar kind and its text, as sent on the wire.

Plain data, compared and hashed by value: the compiled-grammar cache keys on it
(shared/engine/sampling/grammar_compiler.py). Compilation, not this, judges whether the text is
valid. Once compiled for a request, the request's own copy carries its grammar (`compiled`, not
part of its value): the engine finds it there however full the cache is, and the cache's byte
budget counts it until the request is gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 * 1024  # a schema, regex or grammar larger than this is refused


@dataclass(frozen=True)
class StructuredOutput:
    kind: Kind
    # json_schema: the schema as JSON text; regex: the pattern; choice: a JSON array of the
    # allowed strings; grammar: EBNF (GBNF) with a `root` rule; json_object: ""
    spec: str = ""
    # the HeldGrammar compiled for it (shared/engine/sampling/grammar_cache.py), set once by
    # grammar_compiler.compile_async; never sent, compared or copied by dataclasses.replace
    compiled: Any = field(default=None, init=False, compare=False, hash=False, repr=False)

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"sampling.structured.kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
            )
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(
                f"sampling.structured.spec has {len(self.spec)} characters; at most "
                f"{MAX_SPEC_CHARS} allowed"
            )
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"sampling.structured.spec is empty for kind {self.kind}")
