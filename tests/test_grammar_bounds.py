"""Grammar compilation bounded in bytes and CPU: distinct large schemas stay within the compiled
grammars' byte budget (the process's RSS with them), grammars held by requests in flight count
until the requests are gone, a slow schema is a 400 at its deadline with its worker gone, compiles
past the worker bound wait and then get RESOURCE_EXHAUSTED, and a compile that outgrows its
memory limit is a 400. Real xgrammar, real worker processes, the byte tokenizer's vocabulary."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")

from shared.engine.sampling.grammar_compiler import (
    GrammarBusy,
    GrammarCompiler,
    GrammarError,
    compile_pool,
)
from shared.engine.sampling.grammar_worker import ZYGOTE, CompilePool
from shared.engine.sampling.structured_output import StructuredOutput
from shared.model.tokenizer import ByteTokenizer

MIB = 2**20


def large_enum(tag: int) -> StructuredOutput:
    """An object whose one property is a 4,000-value enum: ~27 MB compiled (its token-mask
    cache), from a 128 KB schema."""
    values = [f"value-{tag}-{i:06d}-xxxxxxxx" for i in range(4000)]
    schema = {"type": "object", "properties": {"a": {"enum": values}}, "required": ["a"]}
    return StructuredOutput("json_schema", json.dumps(schema))


def slow_schema(tag: int) -> StructuredOutput:
    """1,500 optional properties: tens of seconds to compile (xgrammar's optional properties)."""
    props = {f"p{tag}_{i}": {"type": "string"} for i in range(1500)}
    return StructuredOutput("json_schema", json.dumps({"type": "object", "properties": props}))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def zygote_children() -> set[int]:
    """The live compile workers: the zygote's children."""
    assert ZYGOTE._proc is not None
    zygote, found = ZYGOTE._proc.pid, set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
            if int(fields["PPid"]) == zygote and not fields["State"].startswith("Z"):
                found.add(int(entry.name))
    return found


def _assert_drained(pool: CompilePool) -> None:
    """A closed pool's workers all stop (a replacement being started finishes first)."""
    deadline = time.monotonic() + 30
    while pool.workers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.workers == 0


def test_distinct_large_schemas_stay_within_the_byte_budget() -> None:
    budget = 40 * MIB  # one ~27 MB grammar fits, two do not
    compiler = GrammarCompiler(ByteTokenizer(), 259, cache_bytes=budget)

    async def body(tags: range) -> list[int]:
        sizes = []
        for tag in tags:
            spec = large_enum(tag)  # a request's, gone once it is served
            await compiler.compile_async(spec, timeout=120)
            sizes.append(spec.compiled.nbytes)
            del spec
            gc.collect()
            assert compiler.cache.held_bytes <= budget
        return sizes

    asyncio.run(body(range(1)))  # warm: the zygote, a worker, this process's first large grammar
    before = rss_bytes()
    sizes = asyncio.run(body(range(1, 6)))
    grown = rss_bytes() - before
    print(f"RSS grew {grown / MIB:.0f} MiB over {len(sizes)} grammars of {sizes[0] / MIB:.0f} MiB")
    assert min(sizes) > 20 * MIB, sizes  # large enough that keeping them all would show
    assert len(compiler) == 1 and compiler.cache.held_bytes == compiler.cache.cached_bytes
    # five more compiled (over 100 MB unbounded): this process grew by less than two
    assert grown < 2 * min(sizes), f"RSS grew {grown / MIB:.0f} MiB"


def test_grammars_of_requests_in_flight_count_until_they_are_gone() -> None:
    requests = [large_enum(100), large_enum(101)]  # two requests' specs
    compiler = GrammarCompiler(ByteTokenizer(), 259, cache_bytes=40 * MIB)

    async def held_while_in_flight(first: StructuredOutput, second: StructuredOutput) -> int:
        await compiler.compile_async(first, timeout=120)  # `first` holds it, as a request would
        with pytest.raises(GrammarBusy, match="no room"):
            await compiler.compile_async(second, timeout=120)
        assert compiler.cache.held_bytes == first.compiled.nbytes
        assert compiler.get(first) is first.compiled.grammar  # the engine finds it on the spec
        return int(first.compiled.nbytes)

    size = asyncio.run(held_while_in_flight(*requests))
    second = requests.pop()
    requests.clear()  # the first request is gone: only the cache holds its grammar
    gc.collect()
    asyncio.run(compiler.compile_async(second, timeout=120))
    assert compiler.cache.held_bytes == second.compiled.nbytes <= 40 * MIB < size * 2


def test_a_slow_schema_is_a_400_at_its_deadline_and_its_worker_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiler = GrammarCompiler(ByteTokenizer(), 259)
    timeout = 2.0
    # the deadline is what this checks: on a fast machine the compile passes the memory limit
    # (its own test) within the 2 s
    monkeypatch.setattr(compile_pool(), "limit_bytes", 4 << 30)

    async def body() -> tuple[float, set[int]]:
        await compiler.compile_async(StructuredOutput("regex", "[ab]{3}"), timeout=120)  # warm
        start = time.monotonic()
        task = asyncio.ensure_future(compiler.compile_async(slow_schema(0), timeout=timeout))
        await asyncio.sleep(timeout / 2)
        busy = zygote_children()
        with pytest.raises(GrammarError, match=r"did not compile within 2s; simplify it"):
            await task
        return time.monotonic() - start, busy

    elapsed, busy = asyncio.run(body())
    assert timeout <= elapsed < timeout + 1.5, elapsed
    deadline = time.monotonic() + 5
    while busy & zygote_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    still = busy & zygote_children()
    # the idle workers are still there; the one that compiled is not
    assert len(still) < len(busy), (busy, still)

    async def trivial() -> float:
        start = time.monotonic()
        await compiler.compile_async(StructuredOutput("regex", "[xy]{4}"), timeout=120)
        return time.monotonic() - start

    assert asyncio.run(trivial()) < 2.0


def test_compiles_past_the_worker_bound_wait_then_get_resource_exhausted() -> None:
    compiler = GrammarCompiler(ByteTokenizer(), 259)
    pool = CompilePool(1, 256 * MIB)

    async def body() -> list[BaseException | None]:
        async def one(tag: int) -> BaseException | None:
            spec = slow_schema(tag)
            try:
                await pool.compile(compiler.key, compiler.vocab_json(), spec, timeout=2.0)
            except (GrammarError, GrammarBusy) as e:
                return e
            return None

        return await asyncio.gather(one(1), one(2))

    try:
        results = asyncio.run(body())
    finally:
        pool.close()
    kinds = sorted(type(r).__name__ for r in results)
    assert kinds == ["GrammarBusy", "GrammarError"], results
    busy = next(r for r in results if isinstance(r, GrammarBusy))
    assert "compile workers stayed busy" in str(busy) and busy.retry_after_s >= 1
    _assert_drained(pool)  # the one worker was killed at its deadline; none replace it now


def test_a_compile_that_outgrows_its_memory_limit_is_a_400() -> None:
    compiler = GrammarCompiler(ByteTokenizer(), 259)
    pool = CompilePool(1, 4 * MIB)

    async def body() -> None:
        with pytest.raises(GrammarError, match="needs more than 4 MiB to compile"):
            await pool.compile(compiler.key, compiler.vocab_json(), large_enum(7), timeout=120)

    try:
        asyncio.run(body())
    finally:
        pool.close()
    _assert_drained(pool)
