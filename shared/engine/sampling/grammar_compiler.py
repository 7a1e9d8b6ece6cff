"""Structured outputs' grammars: a request's StructuredOutput compiled against the model's
vocabulary (xgrammar where the `structured` extra is installed, else llguidance:
grammar_kinds.backend), held in a cache bounded in bytes per tokenizer (grammar_cache.py).

The serving layers compile before a request is queued (`compile_async`), in worker processes
killed at the request's deadline, at most COMPILE_WORKERS at once per node (grammar_worker.py),
and hand the grammar to the engine on the request's StructuredOutput. The engine thread takes it
from there (`GrammarCompiler.get`); only a request that never went through `compile_async` (the
offline LLM API) is compiled on the thread that asks. llguidance compiles in-process, on a
thread, bounded by its own fuel limits (grammar_llguidance.py): no worker to kill.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from shared.engine.sampling.grammar_cache import CACHE_BYTES, GrammarCache, HeldGrammar
from shared.engine.sampling.grammar_kinds import (
    GrammarBusy,
    GrammarError,
    backend,
    compile_spec,
    field_of,
    xgrammar,
)
from shared.engine.sampling.grammar_llguidance import (
    LlgGrammar,
    LlgMatcher,
    compile_llg,
    llg_tokenizer,
)
from shared.engine.sampling.grammar_worker import WORKER_NICE, ZYGOTE, CompilePool
from shared.engine.sampling.structured_output import StructuredOutput
from shared.model.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

__all__ = [
    "GrammarBusy",
    "GrammarCompiler",
    "GrammarError",
    "compile_async",
    "compile_pool",
    "compiler_for",
    "xgrammar",
]

COMPILE_TIMEOUT_S = 10.0  # longer is a 400: the schema is too large or too ambiguous
COMPILE_WORKERS = 8  # compiles at once per node (each in a worker process, at nice 19)
COMPILE_LIMIT_BYTES = 192 * 1024 * 1024  # one compile's heap growth past this is a 400
# in-process compiles (llguidance's; xgrammar's too large to ship) run one at a time: a compile
# holds the GIL for much of its ~70 ms, so more threads only take turns with the engine's, and
# each thread's malloc arena keeps what its compiles freed (8 concurrent 2,000-property schemas
# on SmolLM2: one thread answered them in 1.1-4.3 s, the node +115 MB; eight in 3.1-4.0 s, +190)
BACKGROUND_THREADS = 1


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


class _Abandoned(Exception):
    """A shared compile's request went away before it finished: a waiter compiles itself."""


def _cancelled(e: BaseException) -> bool:
    return isinstance(e, asyncio.CancelledError | KeyboardInterrupt | SystemExit)


class GrammarCompiler:
    """One tokenizer's grammars: compiled in the worker pool (`compile_async`) or here (`get`),
    held in a byte-bounded cache; thread-safe (the serving threads compile, the engine thread
    reads)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_bytes: int = CACHE_BYTES):
        self.backend = backend()
        self.vocab_size = vocab_size
        self.cache = GrammarCache(cache_bytes)
        self.key = f"{os.getpid()}-{id(self)}"  # the workers' name for this vocabulary
        if self.backend == "llguidance":
            self.llg = llg_tokenizer(tokenizer, vocab_size)
        else:
            self.info = tokenizer_info(tokenizer, vocab_size)
            self._compiler = xgrammar().GrammarCompiler(
                self.info, max_threads=1, cache_enabled=False
            )
        self._vocab_json: str | None = None
        self._lock = threading.Lock()
        # the compiles running, by spec: a request with the same spec waits for that one
        self._inflight: dict[StructuredOutput, Future[HeldGrammar]] = {}

    def __len__(self) -> int:
        return len(self.cache)

    def vocab_json(self) -> str:
        with self._lock:
            if self._vocab_json is None:
                self._vocab_json = self.info.serialize_json()
            return self._vocab_json

    def get(self, spec: StructuredOutput) -> xgr.CompiledGrammar | LlgGrammar:
        """The request's grammar: the one `compile_async` gave it, else the cache's, else
        compiled here (blocking; only for requests that skipped `compile_async`)."""
        held = spec.compiled or self.cache.get(spec)
        if held is None:
            held = self.cache.put(spec, self._compile(spec))
        assert isinstance(held, HeldGrammar)
        return held.grammar

    async def compile_async(
        self,
        spec: StructuredOutput,
        timeout: float = COMPILE_TIMEOUT_S,
        deadline: float | None = None,
    ) -> None:
        """Compile `spec` in a worker (see CompilePool.compile) into the cache and onto `spec`
        itself. GrammarError: invalid, too slow, too large; GrammarBusy: no worker free in time,
        or the grammars in use leave no room for it. Requests with the same spec at once share
        one compile (and its outcome)."""
        while True:
            held = spec.compiled or self.cache.get(spec)
            if held is not None:
                break
            with self._lock:
                shared = self._inflight.get(spec)
                if shared is None:
                    mine: Future[HeldGrammar] = Future()
                    self._inflight[spec] = mine
            if shared is None:
                held = await self._compile_shared(spec, mine, timeout, deadline)
                break
            try:  # bounded: by the compile's own time limit
                # shielded: a waiter that goes away must not cancel the compile it shares
                held = await asyncio.shield(asyncio.wrap_future(shared))
                break
            except _Abandoned:  # its request went away mid-compile: compile it here
                continue
        object.__setattr__(spec, "compiled", held)  # frozen; `compiled` is not part of its value

    async def _compile_shared(
        self,
        spec: StructuredOutput,
        mine: Future[HeldGrammar],
        timeout: float,
        deadline: float | None,
    ) -> HeldGrammar:
        try:
            held = await self._compile_new(spec, timeout, deadline)
        except BaseException as e:
            self._finish(spec, mine, exception=_Abandoned() if _cancelled(e) else e)
            raise
        self._finish(spec, mine, result=held)
        return held

    def _finish(
        self,
        spec: StructuredOutput,
        mine: Future[HeldGrammar],
        result: HeldGrammar | None = None,
        exception: BaseException | None = None,
    ) -> None:
        with self._lock:
            del self._inflight[spec]
        if exception is not None:
            mine.set_exception(exception)
        else:
            mine.set_result(result)  # type: ignore[arg-type]

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar | LlgGrammar:
        if self.backend == "llguidance":
            return compile_llg(self.llg, spec)
        return compile_spec(self._compiler, spec)

    async def _compile_new(
        self, spec: StructuredOutput, timeout: float, deadline: float | None
    ) -> HeldGrammar:
        if self.backend == "llguidance":
            return await self._compile_here(spec, timeout, deadline)
        plain = StructuredOutput(spec.kind, spec.spec)  # what goes to the worker
        pool = compile_pool()
        result = await pool.compile(self.key, self.vocab_json(), plain, timeout, deadline)
        self._check_room(spec, result.nbytes)
        if result.payload is not None:
            grammar = await asyncio.to_thread(
                xgrammar().CompiledGrammar.deserialize_json, result.payload, self.info
            )
        else:  # too large to ship: compiled again, bounded by the worker's proof
            grammar = await asyncio.get_running_loop().run_in_executor(
                _background(), compile_spec, self._compiler, spec
            )
        return self.cache.put(spec, grammar)

    async def _compile_here(
        self, spec: StructuredOutput, timeout: float, deadline: float | None
    ) -> HeldGrammar:
        """llguidance's compile on a low-priority thread: its fuel limits end it in milliseconds;
        the request's time bound still answers first (the thread finishes soon after)."""
        end = (
            time.monotonic() + timeout
            if deadline is None
            else min(deadline, time.monotonic() + timeout)
        )
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(_background(), compile_llg, self.llg, spec)
        try:
            grammar = await asyncio.wait_for(work, max(end - time.monotonic(), 0.0))
        except TimeoutError:
            raise GrammarError(
                field_of(spec),
                f"the {spec.kind} did not compile within {timeout:.3g}s; simplify it",
            ) from None
        self._check_room(spec, grammar.memory_size_bytes)
        return self.cache.put(spec, grammar)

    def _check_room(self, spec: StructuredOutput, nbytes: int) -> None:
        if nbytes > self.cache.budget_bytes:
            raise GrammarError(
                field_of(spec),
                f"the {spec.kind} compiles to {nbytes / 2**20:.0f} MiB, more than this node "
                f"holds for all grammars ({self.cache.budget_bytes / 2**20:.0f} MiB); make it "
                "smaller (fewer enum values, properties or alternatives)",
            )
        if not self.cache.fits(nbytes):
            raise GrammarBusy(
                f"the grammars of requests in flight leave no room for this {spec.kind}'s "
                f"({nbytes / 2**20:.0f} MiB of {self.cache.budget_bytes / 2**20:.0f}); "
                "retry later"
            )

    def allows(self, spec: StructuredOutput, tokens: Sequence[int]) -> bool:
        """Whether the grammar accepts these tokens as the start of an output."""
        matcher = self.matcher(spec)
        return all(matcher.accept_token(t) for t in tokens)

    def matcher(self, spec: StructuredOutput) -> xgr.GrammarMatcher | LlgMatcher:
        """A fresh parser state for `spec` (accept_token, fill_next_token_bitmask,
        is_terminated)."""
        grammar = self.get(spec)
        if isinstance(grammar, LlgGrammar):
            return LlgMatcher(grammar)
        return xgrammar().GrammarMatcher(grammar)


_state_lock = threading.Lock()
_compile_pool: CompilePool | None = None
_background_pool: ThreadPoolExecutor | None = None


def compile_pool() -> CompilePool:
    """The node's compile workers, one pool for every tokenizer."""
    global _compile_pool
    with _state_lock:
        if _compile_pool is None:
            _compile_pool = CompilePool(COMPILE_WORKERS, COMPILE_LIMIT_BYTES)
        return _compile_pool


def _lower_priority() -> None:
    """This thread (Linux: a thread's nice value is its own) yields to the engine's."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)


def _background() -> ThreadPoolExecutor:
    global _background_pool
    with _state_lock:
        if _background_pool is None:
            _background_pool = ThreadPoolExecutor(
                BACKGROUND_THREADS, "grammar-compile", initializer=_lower_priority
            )
        return _background_pool


_compilers: dict[tuple[int, str], tuple[Tokenizer, GrammarCompiler]] = {}
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
    """The one compiler of this tokenizer (built on first use; keeps the tokenizer alive, so
    its id is not reused)."""
    key = (id(tokenizer), backend())
    with _compilers_lock:
        entry = _compilers.get(key)
        if entry is None or entry[1].vocab_size != vocab_size:
            entry = (tokenizer, GrammarCompiler(tokenizer, vocab_size))
            _compilers[key] = entry
        return entry[1]


async def compile_async(
    tokenizer: Tokenizer,
    vocab_size: int,
    spec: StructuredOutput,
    timeout: float = COMPILE_TIMEOUT_S,
    deadline: float | None = None,
) -> None:
    """Compile `spec` for a request (see GrammarCompiler.compile_async) in at most `timeout`
    seconds of a worker's time and before `deadline` (monotonic seconds: the request's own)."""
    xgr_workers = backend() == "xgrammar"
    if spec.compiled is None and xgr_workers:
        ZYGOTE.warm()  # no-op once up; else it starts while this node builds the vocabulary
    compiler = await asyncio.to_thread(compiler_for, tokenizer, vocab_size)
    if xgr_workers:
        compile_pool().refill((compiler.key, compiler.vocab_json()))  # workers ahead, from now on
    await compiler.compile_async(spec, timeout, deadline)
