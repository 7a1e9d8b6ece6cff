from __future__ import annotations

import pytest

from shared.cdiv import cdiv
from shared.engine.resources.block_manager import (
    BlockManager,
    NoFreeBlocksError,
    compute_block_hashes,
)


def test_cdiv() -> None:
    assert [cdiv(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        cdiv(3, 0)


def test_exact_ids_fifo_and_refcounts() -> None:
    bm = BlockManager(8, 4)
    a = bm.allocate(3)
    b = bm.allocate(2)
    assert a == [0, 1, 2] and b == [3, 4]
    assert bm.num_free_blocks == 3
    bm.free(a)  # freed tail first: 2, 1, 0 join the back of the FIFO
    assert bm.allocate(5) == [5, 6, 7, 2, 1]
    assert bm.ref_count(0) == 0 and bm.ref_count(1) == 1
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2)
    bm.check_integrity()


def test_double_free_asserts() -> None:
    bm = BlockManager(4, 4)
    a = bm.allocate(1)
    bm.free(a)
    with pytest.raises(AssertionError):
        bm.free(a)


def test_prefix_cache_refcounts_and_lru_eviction_order() -> None:
    bm = BlockManager(4, 2)
    tokens_a = [1, 2, 3, 4]
    tokens_b = [9, 9, 8, 8]
    ha = compute_block_hashes(tokens_a, 2)
    hb = compute_block_hashes(tokens_b, 2)
    a = bm.allocate(2)
    for block, h in zip(a, ha, strict=True):
        bm.cache_block(block, h)
    b = bm.allocate(2)
    for block, h in zip(b, hb, strict=True):
        bm.cache_block(block, h)
    assert bm.match_prefix(ha) == a
    # a second user of a's prefix shares the blocks
    bm.acquire(a)
    assert [bm.ref_count(x) for x in a] == [2, 2]
    bm.free(a)
    bm.free(a)  # now unreferenced but cached: evictable, still matchable
    assert bm.num_free_blocks == 2 and bm.match_prefix(ha) == a
    bm.free(b)
    # LRU: a's blocks were released first (tail first: a[1], a[0]) so they are evicted first
    assert bm.allocate(1) == [a[1]]
    assert bm.match_prefix(ha) == [a[0]]  # chain broken after the evicted block
    assert bm.allocate(1) == [a[0]]
    assert bm.match_prefix(ha) == []
    assert bm.match_prefix(hb) == b
    bm.check_integrity()


def test_chained_hash_depends_on_prefix() -> None:
    h1 = compute_block_hashes([1, 2, 3, 4], 2)
    h2 = compute_block_hashes([5, 6, 3, 4], 2)
    assert h1[1] != h2[1]  # same block content, different prefix
    assert compute_block_hashes([1, 2, 3], 2) == h1[:1]  # partial block not hashed


def test_pinned_block_never_evicted_or_reallocated() -> None:
    bm = BlockManager(2, 2)
    (blk,) = bm.allocate(1)
    bm.cache_block(blk, compute_block_hashes([1, 2], 2)[0])
    bm.pin([blk])
    bm.free([blk])  # last reference gone while a transfer still reads it
    assert bm.is_pinned(blk) and bm.num_free_blocks == 1
    assert bm.allocate(1) == [1]
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1)
    bm.check_integrity()
    bm.unpin([blk])
    assert bm.num_free_blocks == 1
    assert bm.allocate(1) == [blk]  # evicted only now
    with pytest.raises(AssertionError):
        bm.unpin([blk])
    bm.free([blk])
    bm.free([1])
    bm.check_all_free()


def test_conservation_check_reports_held_blocks() -> None:
    bm = BlockManager(3, 4)
    bm.allocate(1)
    with pytest.raises(AssertionError, match="still held"):
        bm.check_all_free()


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(2, 2, enable_prefix_caching=False)
    (blk,) = bm.allocate(1)
    h = compute_block_hashes([1, 2], 2)
    bm.cache_block(blk, h[0])
    assert bm.match_prefix(h) == []
    bm.free([blk])
    bm.check_all_free()


def test_block_hashes_are_a_sha256_chain_however_they_are_extended() -> None:
    """The hash is a wire-level key (routers on other nodes predict this node's cache with it):
    block i's = sha256(block i-1's + block i's int64 token ids)[:16], extended in any pieces."""
    import hashlib
    from array import array

    from shared.engine.resources.block_manager import extend_block_hashes

    tokens = [(i * 7919) % 50_000 for i in range(70)]
    parent, want = b"", []
    for i in range(70 // 16):
        parent = hashlib.sha256(parent + array("q", tokens[i * 16 : i * 16 + 16]).tobytes())
        parent = parent.digest()[:16]
        want.append(parent)
    assert compute_block_hashes(tokens, 16) == want
    pieces: list[bytes] = []
    for end in (5, 16, 40, 40, 70):
        extend_block_hashes(pieces, tokens[:end], 16)
    assert pieces == want


def test_carried_prompt_hashes_spare_the_engine_a_second_pass(monkeypatch) -> None:
    """A prompt is hashed once: by its creator (carried in) or by its first prefix match; the
    match and the caching of its blocks reuse those hashes, hashing only tokens past the
    prompt, with the same result as hashing from scratch."""
    from shared.engine.requests.request import LlmRequest
    from shared.engine.resources import resource_manager
    from shared.engine.resources.resource_manager import KVCacheManager
    from shared.engine.sampling.sampling_params import SamplingParams

    calls: list[int] = []
    real = resource_manager.extend_block_hashes

    def counting(hashes, tokens, block_size, seed=b""):
        calls.append(len(tokens) // block_size - len(hashes))  # blocks hashed here
        return real(hashes, tokens, block_size, seed)

    monkeypatch.setattr(resource_manager, "extend_block_hashes", counting)
    prompt = list(range(100, 150))  # 3 full blocks of 16, 2 tokens over
    kv = KVCacheManager(16, 16, 4)
    first = LlmRequest("a", prompt, SamplingParams(max_tokens=4))
    assert kv.acquire_prefix(first) == 0
    kv.reserve(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(first)
    assert calls == [3]  # the match hashed the prompt; caching its blocks reused the hashes
    expected = kv.block_hashes["a"]
    assert expected == compute_block_hashes(prompt, 16)

    calls.clear()
    second = LlmRequest("b", prompt, SamplingParams(max_tokens=20))
    second.prompt_block_hashes = compute_block_hashes(prompt, 16)  # carried in
    assert kv.acquire_prefix(second) == 48  # every full block but the one holding the last token
    kv.reserve(second, len(prompt) + 16)
    second.output_token_ids = list(range(16))
    second.num_computed_tokens = len(prompt) + 16
    kv.cache_computed_blocks(second)
    assert calls == [1]  # the one block past the prompt, none of the prompt's
    assert kv.block_hashes["b"][:3] == expected
    assert kv.block_hashes["b"] == compute_block_hashes(second.all_token_ids, 16)
    kv.free_resources(first)
    kv.free_resources(second)
    kv.check_conservation()
