"""Structured outputs' grammars: a request's StructuredOutput compiled against the model's
vocabulary (xgrammar), cached in a bounded LRU per tokenizer.

Compiling a large schema can take a while, so the serving layers compile off the engine thread
(`compile_async`, with a time limit) before a request is queued; the engine thread then finds
the grammar here. Should the LRU have dropped it meanwhile, the engine compiles it again (the
spec already compiled once, so it is valid).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from shared.engine.errors import RequestRejected
from shared.engine.sampling.structured_output import StructuredOutput
from shared.model.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

CACHE_ENTRIES = 64  # compiled grammars kept per tokenizer
COMPILE_TIMEOUT_S = 10.0  # longer is a 400: the schema is too large or too ambiguous


class GrammarError(RequestRejected):
    """The spec does not compile (INVALID_ARGUMENT / 400); `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


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


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """Each token id's bytes as xgrammar reads them; specials have none (never grammar text);
    the model's vocabulary may be wider than the tokenizer's (padding rows: never allowed)."""
    xgr = xgrammar()
    stops = sorted(tokenizer.eos_token_ids)
    if isinstance(tokenizer, ByteTokenizer):
        vocab: list[bytes] = [bytes([i]) for i in range(256)]
        vocab += [b""] * (min(tokenizer.vocab_size, vocab_size) - 256)
        return xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops
        )
    assert isinstance(tokenizer, HfTokenizer)
    backend = tokenizer.backend
    ids = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * min(max(ids.values()) + 1, vocab_size)
    for text, i in ids.items():
        if i < len(encoded):
            encoded[i] = text
    for i, added in backend.get_added_tokens_decoder().items():
        if added.special and i < len(encoded):
            encoded[i] = ""
    vocab_type, prefix_space = _vocab_type(json.loads(backend.to_str()))
    return xgr.TokenizerInfo(
        encoded,
        vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stops,
        add_prefix_space=prefix_space,
    )


def _vocab_type(spec: dict) -> tuple[xgr.VocabType, bool]:
    """How tokenizer.json spells bytes in its vocabulary: GPT-2's byte-level alphabet, or
    SentencePiece's `▁` with <0xNN> byte fallback, or raw text."""
    xgr = xgrammar()
    text = json.dumps(spec.get("decoder"))
    if "ByteLevel" in text:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in text:
        normalizer, pre = json.dumps(spec.get("normalizer")), json.dumps(spec.get("pre_tokenizer"))
        prepends = "Prepend" in normalizer or '"prepend_scheme": "always"' in pre
        return xgr.VocabType.BYTE_FALLBACK, prepends
    return xgr.VocabType.RAW, False


class GrammarCompiler:
    """One tokenizer's compiler and its LRU of compiled grammars; thread-safe (the serving
    threads compile, the engine thread reads)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, entries: int = CACHE_ENTRIES):
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.vocab_size = vocab_size
        self._compiler = xgrammar().GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._entries = entries
        self._cache: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._entries:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        field = f"sampling.structured ({spec.kind})"
        try:
            if spec.kind == "json_schema":
                # one space after `:` and `,`, no other whitespace: a weak model cannot spend its
                # tokens on newlines, and the text is what json.dumps writes
                return self._compiler.compile_json_schema(spec.spec, any_whitespace=False)
            if spec.kind == "json_object":
                # OpenAI's json_object is an object (xgrammar's builtin JSON is any value)
                return self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False
                )
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                return self._compiler.compile_regex(_choice_regex(spec.spec))
            return self._compiler.compile_grammar(spec.spec)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own kinds
            raise GrammarError(field, f"invalid {spec.kind}: {_reason(e)}") from None

    def allows(self, spec: StructuredOutput, tokens: Sequence[int]) -> bool:
        """Whether the grammar accepts these tokens as the start of an output."""
        matcher = xgrammar().GrammarMatcher(self.get(spec))
        return all(matcher.accept_token(t) for t in tokens)


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location and check boilerplate."""
    lines = str(e).strip().splitlines()
    text = _LOCATION.sub("", lines[0] if lines else type(e).__name__)
    return text.replace("Check failed: (error.empty()) is false: ", "")[:500]


_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _choice_regex(spec: str) -> str:
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


_compilers: dict[int, tuple[Tokenizer, GrammarCompiler]] = {}
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
    """The one compiler of this tokenizer (built on first use; keeps the tokenizer alive, so
    its id is not reused)."""
    with _compilers_lock:
        entry = _compilers.get(id(tokenizer))
        if entry is None or entry[1].vocab_size != vocab_size:
            entry = (tokenizer, GrammarCompiler(tokenizer, vocab_size))
            _compilers[id(tokenizer)] = entry
        return entry[1]


async def compile_async(
    tokenizer: Tokenizer,
    vocab_size: int,
    spec: StructuredOutput,
    timeout: float = COMPILE_TIMEOUT_S,
) -> None:
    """Compile into the cache on a worker thread (never the engine's or the event loop's);
    GrammarError on an invalid spec or past `timeout` (the compile finishes in the
    background, its result cached)."""
    try:
        await asyncio.wait_for(
            asyncio.to_thread(lambda: compiler_for(tokenizer, vocab_size).get(spec)), timeout
        )
    except TimeoutError:
        raise GrammarError(
            f"sampling.structured ({spec.kind})",
            f"the {spec.kind} did not compile within {timeout:g}s; simplify it",
        ) from None
