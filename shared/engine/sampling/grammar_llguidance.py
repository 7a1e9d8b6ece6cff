"""Structured outputs with llguidance: the grammar library of a default install (no extras).

llguidance is a 3 MB Rust wheel with no dependencies; xgrammar (the `structured` extra) brings
transformers and triton (~1 GB). Its compile is cheap (a grammar's lexer is built lazily, one
token step at a time) and bounded by fuel: `LIMITS` caps the regex analysis, each mask step and
the lexer states a matcher may build, so a compile here needs no worker process to be killed at
a deadline: it runs in-process, on a thread, and ends within those limits (≤ 9 ms for each schema
of tests/structured_corpus.py with SmolLM2's vocabulary).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from shared.engine.sampling.grammar_kinds import GrammarError, choice_regex, field_of
from shared.engine.sampling.structured_output import StructuredOutput
from shared.model.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer

# per matcher: at most 20k lexer states (1-2 kB each: ≤ 40 MB), a step within ~15 ms of fuel;
# Earley rows of up to 10k items: an object of ~2,400 optional properties (four items each) where
# the default 2,000 stops at ~500, and a step's mask stays under ~50 ms. A grammar past a limit
# puts its matcher in an error state mid-answer, which ends that request alone (grammar_rows.py)
LIMITS = llguidance.LLParserLimits(
    max_lexer_states=20_000, step_lexer_fuel=200_000, max_items_in_row=10_000
)
# one space after `:` and `,`, no other whitespace, as the xgrammar backend writes: a weak model
# cannot spend its tokens on newlines, and the text is what json.dumps writes
_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# a compiled grammar's bytes, estimated: its text, the grammar built from it and its start-state
# matcher grow with the grammar's size (measured: ~125 bytes per character of the grammar's
# text for objects of 2,000 properties on SmolLM2's vocabulary)
_BASE_BYTES = 256 * 1024
_BYTES_PER_CHAR = 128


class _ByteVocab:
    """A ByteTokenizer as llguidance's TokenizerWrapper reads one: token i < 256 is byte i."""

    def __init__(self, tokenizer: ByteTokenizer, vocab_size: int):
        eos = sorted(tokenizer.eos_token_ids)
        self.eos_token_id = eos[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256)
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def llg_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The node's tokenizer as llguidance sees it: tokenizer.json as the HF tokenizers library
    serializes it (llguidance reads its byte-level or byte-fallback vocabulary and its special
    tokens itself), widened to the model's vocabulary (padding rows: never allowed)."""
    stops = sorted(tokenizer.eos_token_ids)
    if isinstance(tokenizer, ByteTokenizer):
        wrapper = llguidance.TokenizerWrapper(_ByteVocab(tokenizer, vocab_size))
        return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=stops)
    assert isinstance(tokenizer, HfTokenizer)
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=stops)


class LlgGrammar:
    """A validated grammar for one tokenizer; `memory_size_bytes` as the cache counts it.

    `template` is a matcher in its start state, built where the grammar is compiled (a compile
    thread): building one parses and compiles the grammar (0.3 s for an object of 1,500
    properties on SmolLM2's vocabulary), a copy of it takes microseconds, so a seat's matcher
    is a copy and the engine thread never compiles."""

    __slots__ = ("grammar", "memory_size_bytes", "template")

    def __init__(self, grammar: str, template: llguidance.LLMatcher):
        self.grammar = grammar
        self.template = template
        self.memory_size_bytes = _BASE_BYTES + _BYTES_PER_CHAR * len(grammar)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else")


def closed(schema: Any) -> Any:
    """`schema` with each object that lists `properties` and says nothing of others closed to
    them (`additionalProperties: false`), as xgrammar's strict mode reads a schema: a model must
    not spend its tokens on properties nobody asked for."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = closed(out[key])
    others = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if "properties" in out and not any(k in out for k in others):
        out["additionalProperties"] = False
    return out


def _grammar_text(spec: StructuredOutput) -> str:
    matcher = llguidance.LLMatcher
    if spec.kind == "json_schema":
        try:
            schema = closed(json.loads(spec.spec))
            return matcher.grammar_from_json_schema(json.dumps(schema), overrides=_JSON)  # type: ignore[arg-type]
        except ValueError as e:
            raise GrammarError(field_of(spec), f"invalid json_schema: {e}") from None
    if spec.kind == "json_object":  # OpenAI's json_object is an object, not any JSON value
        return matcher.grammar_from_json_schema('{"type": "object"}', overrides=_JSON)  # type: ignore[arg-type]
    if spec.kind == "regex":
        return matcher.grammar_from_regex(ascii_classes(spec.spec))
    if spec.kind == "choice":
        return matcher.grammar_from_regex(choice_regex(spec.spec))
    return matcher.grammar_from_lark(gbnf_to_lark(spec.spec))


# \d \w \s as xgrammar and JSON Schema's (ECMA-262) regexes read them: ASCII; llguidance's
# (Rust's) are Unicode (\d would allow "߁", an N'Ko digit)
_IN_CLASS = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \\t\\n\\r\\f\\v"}
_OUTSIDE = {
    **{k: f"[{v}]" for k, v in _IN_CLASS.items()},
    **{k.upper(): f"[^{v}]" for k, v in _IN_CLASS.items()},
}


def ascii_classes(regex: str) -> str:
    r"""`regex` with its \d \w \s (and \D \W \S outside brackets) spelled as ASCII sets."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            table = _IN_CLASS if in_class else _OUTSIDE
            out.append(table.get(nxt, c + nxt))
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            if regex[i + 1 : i + 2] == "^":  # a leading ] is literal, after ^ too
                out.append("[^")
                i += 1
                c = ""
            if regex[i + 1 : i + 2] == "]":
                out.append(c + "]")
                i += 2
                continue
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def compile_llg(tokenizer: llguidance.LLTokenizer, spec: StructuredOutput) -> LlgGrammar:
    """`spec` validated against `tokenizer`; GrammarError naming what llguidance refuses (an
    unsupported schema keyword or format, a bad regex, a grammar over LIMITS)."""
    try:
        text = _grammar_text(spec)
    except GrammarError:
        raise
    except Exception as e:  # gbnf_to_lark raises on a grammar it cannot read
        raise GrammarError(field_of(spec), f"invalid {spec.kind}: {str(e)[:500]}") from None
    template = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=LIMITS)
    if template.is_error():  # what validate_grammar says, from the one compile
        raise GrammarError(field_of(spec), f"invalid {spec.kind}: {_reason(template.get_error())}")
    return LlgGrammar(text, template)


def _reason(error: str) -> str:
    """llguidance's message in one line: its first, plus the regex parser's `error:` line (the
    lines between draw a caret under the pattern)."""
    lines = [line.strip() for line in error.strip().splitlines()]
    detail = next((line for line in lines[1:] if line.startswith("error:")), "")
    return " ".join(filter(None, [lines[0] if lines else "", detail]))[:500]


class LlgMatcher:
    """One seat's parser state, with the calls grammar_rows makes of xgrammar's matcher."""

    def __init__(self, grammar: LlgGrammar):
        self._m = grammar.template.deep_copy()

    def accept_token(self, token: int) -> bool:
        return not self._m.is_error() and self._m.consume_token(token)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def error(self) -> str:
        """Why the matcher stopped (a limit crossed), in one line; "" when it has not."""
        if not self._m.is_error():
            return ""
        return self._m.get_error().strip().splitlines()[0][:300]


def allows(grammar: LlgGrammar, tokens: Sequence[int]) -> bool:
    matcher = LlgMatcher(grammar)
    return all(matcher.accept_token(t) for t in tokens)


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Set to -inf, in place, each token of `logits` ([rows, vocab]) whose bit in `mask` ([rows,
    words] int32 on CPU, bit i of word w: token 32w + i) is 0. On CPU numpy's unpackbits reads
    the words' little-endian bytes in token order (no torch JIT kernel to build); on a GPU the
    bits are unpacked there."""
    vocab = logits.shape[-1]
    if logits.device.type == "cpu":
        import numpy as np

        bits = np.unpackbits(mask.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
        # negated in numpy: torch's CPU `~` on 1.5M bools costs more than the fill itself
        forbidden = torch.from_numpy(bits[:, :vocab] == 0)
    else:
        forbidden = forbidden_on_device(mask.to(logits.device, non_blocking=True), vocab)
    logits.masked_fill_(forbidden, float("-inf"))


def forbidden_on_device(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] True where the token's bit is 0, unpacked with torch ops on the words'
    device (no kernel to build)."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab] == 0
