"""The proxy's cache-aware routing, without a model: prompt keys (text, tokens, chat, gRPC
messages, HTTP bodies) and the router's choice over a real pool of gRPC channels."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from grpc import aio
from prometheus_client import CollectorRegistry

from pdserve.client import build_generate_request
from pdserve.prefix_router import PrefixRouter
from pdserve.prompt_key import (
    GENERATE_METHOD,
    TEXT_CHUNK_BYTES,
    TOKEN_BLOCK,
    chat_key,
    completion_key,
    grpc_key,
    http_key,
    responses_key,
    text_key,
    token_key,
)
from pdserve.proxy_backends import backend_pool
from shared.engine.sampling.sampling_params import SamplingParams
from shared.serving.prefix_index import PrefixIndex, text_hashes
from shared.serving.replica_pool import Replica, ReplicaPool

LONG = "You are a careful assistant. Answer briefly and cite your sources. " * 6  # 402 bytes


def shared_blocks(a: tuple[bytes, ...], b: tuple[bytes, ...]) -> int:
    index = PrefixIndex()
    index.record("n", a)
    return index.matched_blocks("n", b)


def test_text_keys_share_exactly_their_common_chunks() -> None:
    a = text_key(LONG)
    b = text_key(LONG + "Question: what is a block hash?")
    assert a is not None and b is not None
    assert len(a.hashes) == len(LONG) // TEXT_CHUNK_BYTES == 6
    assert a.units == -(-len(LONG) // 4)  # ~4 bytes a token
    assert shared_blocks(a.hashes, b.hashes) == 6
    # one byte different in the first chunk: nothing shared, however much agrees after it
    c = text_key("X" + LONG[1:])
    assert c is not None and shared_blocks(a.hashes, c.hashes) == 0
    # UTF-8, not characters: multi-byte text is chunked by its bytes
    d = text_key("é" * 64)
    assert d is not None and len(d.hashes) == 2
    assert text_key("\ud800") is None  # a lone surrogate is no text
    with pytest.raises(ValueError):
        text_hashes(b"x", 0)


def test_token_keys_use_block_chains_and_never_meet_text() -> None:
    ids = list(range(100))
    a, b = token_key(ids), token_key([*ids[:64], 999, *ids[65:]])
    assert a.units == 100 and len(a.hashes) == 100 // TOKEN_BLOCK
    assert shared_blocks(a.hashes, b.hashes) == 4
    # the same bytes as a chat serialization and as text are different prompts
    text = text_key(LONG)
    chat = text_key(LONG, domain=b"chat")
    assert text is not None and chat is not None and shared_blocks(text.hashes, chat.hashes) == 0


def test_completion_bodies() -> None:
    by_text = completion_key({"prompt": LONG})
    assert by_text == text_key(LONG)
    assert completion_key({"prompt": [LONG, "other"]}) == by_text  # a batch: the first
    assert completion_key({"prompt": [1, 2, 3]}) == token_key([1, 2, 3])
    assert completion_key({"prompt": [[4, 5], [6]]}) == token_key([4, 5])
    for bad in ({}, {"prompt": 5}, {"prompt": []}, {"prompt": [True, 2]}, {"prompt": [None]}):
        assert completion_key(bad) is None, bad


def test_chat_bodies_key_on_roles_and_contents_in_order() -> None:
    system = {"role": "system", "content": LONG}
    turn1 = [system, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    k1, k2 = chat_key({"messages": turn1}), chat_key({"messages": turn2})
    assert k1 is not None and k2 is not None and len(k2.hashes) >= len(k1.hashes) > 0
    assert shared_blocks(k1.hashes, k2.hashes) == len(k1.hashes)  # a conversation grows
    as_user = chat_key({"messages": [{"role": "user", "content": LONG}]})
    assert as_user is not None and shared_blocks(k1.hashes, as_user.hashes) == 0
    parts = [{"type": "text", "text": LONG[:200]}, {"type": "text", "text": LONG[200:]}]
    assert chat_key({"messages": [{"role": "system", "content": parts}]}) == chat_key(
        {"messages": [system]}
    )
    for bad in ({}, {"messages": []}, {"messages": "hi"}, {"messages": [{"content": "x"}]}):
        assert chat_key(bad) is None, bad


def test_responses_bodies_key_as_the_chat_they_run_as() -> None:
    chat = [{"role": "system", "content": LONG}, {"role": "user", "content": "hi"}]
    want = chat_key({"messages": chat})
    assert responses_key({"instructions": LONG, "input": "hi"}) == want
    parts = [{"type": "input_text", "text": "hi"}]
    assert (
        responses_key({"instructions": LONG, "input": [{"role": "user", "content": parts}]}) == want
    )
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c", "output": LONG}
    turn = responses_key({"instructions": LONG, "input": [chat[1], call, output]})
    assert turn is not None and want is not None
    assert shared_blocks(want.hashes, turn.hashes) == len(want.hashes)  # the turn grows it
    assert responses_key({"input": "hi", "previous_response_id": "resp_1"}) is None
    for bad in ({}, {"input": 3}, {"input": [{"type": "reasoning"}]}, {"input": [1]}):
        assert responses_key(bad) is None, bad


def test_http_and_grpc_requests() -> None:
    body = json.dumps({"model": "m", "prompt": LONG}).encode()
    assert http_key("POST", "/v1/completions", body) == text_key(LONG)
    chat = json.dumps({"messages": [{"role": "user", "content": LONG}]}).encode()
    assert http_key("POST", "/v1/chat/completions", chat) is not None
    assert http_key("GET", "/v1/completions", body) is None
    assert http_key("POST", "/v1/models", body) is None
    for bad in (b"{", b"\xff\xfe", b"[1, 2]", b'"x"', b"[" * 100_000):
        assert http_key("POST", "/v1/completions", bad) is None, bad[:8]

    params = SamplingParams(max_tokens=4)
    text = build_generate_request(LONG, params).SerializeToString()
    ids = build_generate_request([7, 8, 9] * 20, params).SerializeToString()
    assert grpc_key(GENERATE_METHOD, text) == text_key(LONG)
    assert grpc_key(GENERATE_METHOD, ids) == token_key([7, 8, 9] * 20)
    assert grpc_key("/pdserve.v1.Generation/GetModelInfo", text) is None
    assert grpc_key(GENERATE_METHOD, None) is None  # the client sent no message
    assert grpc_key(GENERATE_METHOD, b"\xff\xff\xff") is None  # not a GenerateRequest
    assert grpc_key(GENERATE_METHOD, b"") is None  # a request with no prompt


def _pool(n: int) -> ReplicaPool[Replica]:
    """`n` replicas on real (never dialled) gRPC channels, all healthy."""
    pool: ReplicaPool[Replica] = ReplicaPool("backend", (), 1.0, lambda t, h: None)  # type: ignore
    for i in range(n):
        target = f"127.0.0.1:{60000 + i}"
        pool.replicas.append(Replica(target, "127.0.0.1", aio.insecure_channel(target)))
    return pool


def test_router_follows_the_prefix_until_load_outweighs_it() -> None:
    async def main() -> None:
        registry = CollectorRegistry()
        router = PrefixRouter("kv", registry)
        pool = _pool(2)
        base = text_key(LONG * 4)
        assert base is not None
        holder = router.route(pool, base, set())
        assert holder is not None and holder.load == 1 and router.outstanding
        router.release(holder, base)
        assert holder.load == 0 and not router.outstanding
        for i in range(4):  # the pool rotates ties; the shared prefix wins every time
            key = text_key(LONG * 4 + f"question {i}")
            got = router.route(pool, key, set())
            assert got is holder, i
            router.release(got, key)
        unrelated = set()
        for i in range(4):
            key = text_key(f"{i} " * 300)
            got = router.route(pool, key, set())
            assert got is not None
            unrelated.add(got.target)
            router.release(got, key)
        assert len(unrelated) == 2  # no prefix anywhere, equal loads: they rotate over both
        # the holder busy with prompt work larger than the prefix saves: the other one
        router.outstanding[holder.target] = 10 * base.units
        other = router.route(pool, text_key(LONG * 4 + "again"), set())
        assert other is not None and other is not holder
        # tried replicas are skipped (a retry goes elsewhere), however cheap
        assert router.route(pool, base, {holder.target}) is other
        assert router.route(pool, base, {r.target for r in pool.replicas}) is None
        prefix = registry.get_sample_value(
            "pdserve_proxy_routed_total", {"backend": holder.target, "reason": "prefix"}
        )
        assert prefix == 4
        units = "pdserve_proxy_prompt_units_total"
        cached = registry.get_sample_value(units, {"predicted": "cached"})
        assert cached is not None and cached >= 4 * (len(LONG * 4) // 64) * TOKEN_BLOCK
        for r in pool.replicas:
            await r.channel.close()

    asyncio.run(main())


def test_least_loaded_ignores_prefixes_and_unkeyed_calls_go_by_load() -> None:
    async def main() -> None:
        router = PrefixRouter("least-loaded", CollectorRegistry())
        assert not router.uses_keys
        pool = _pool(2)
        key = text_key(LONG * 4)
        first = router.route(pool, key, set())
        assert first is not None
        second = router.route(pool, key, set())  # the first is busy: least-loaded moves on
        assert second is not None and second is not first and len(router.index) == 0
        kv = PrefixRouter("kv", CollectorRegistry())
        a, b = pool.replicas
        a.load, b.load = 0, 5
        assert kv.route(pool, None, set()) is a  # no key: the fewest calls in flight
        with pytest.raises(ValueError, match="routing"):
            PrefixRouter("round-robin", CollectorRegistry())
        for r in pool.replicas:
            await r.channel.close()

    asyncio.run(main())


def test_a_backend_failing_its_health_check_is_forgotten() -> None:
    async def main() -> None:
        router = PrefixRouter("kv", CollectorRegistry())
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            target = f"127.0.0.1:{s.getsockname()[1]}"
        pool = backend_pool([target], 0.2, router.forget)
        key = token_key(list(range(64)))
        router.index.record(target, key.hashes)
        router.index.record("127.0.0.1:1", key.hashes)
        await pool.refresh()  # discovers it, its health check fails: marked unhealthy
        assert router.index.nodes() == {"127.0.0.1:1"}
        await pool.close()

    asyncio.run(main())
