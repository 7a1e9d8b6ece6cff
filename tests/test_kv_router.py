"""KV-aware prefill routing: the pure scorer and index, then two real prefill nodes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from decode_node.config import DecodeNodeConfig
from decode_node.kv_router import PrefixIndex, prefill_cost, prompt_hashes
from pdserve.client import generate
from tests.engine_helpers import hf_greedy, random_prompts, single_torch_thread
from tests.support.cluster import pd_cluster

BS = 16


def test_index_matches_leading_chain_only() -> None:
    index = PrefixIndex()
    a = prompt_hashes(list(range(100)), BS)  # 6 full blocks
    assert len(a) == 6
    index.record("p1", a[:4])
    assert index.matched_blocks("p1", a) == 4
    assert index.matched_blocks("p2", a) == 0
    # a chain that diverges in its first block shares nothing, even if later tokens agree
    b = prompt_hashes([7, *range(1, 100)], BS)
    assert index.matched_blocks("p1", b) == 0
    # a prompt extending a recorded one matches the shared prefix
    c = prompt_hashes([*range(64), *range(500, 540)], BS)
    assert index.matched_blocks("p1", c) == 4


def test_index_is_bounded_lru_and_forgets_nodes() -> None:
    index = PrefixIndex(capacity=8)
    old = prompt_hashes(list(range(80)), BS)  # 5 blocks
    new = prompt_hashes(list(range(1000, 1080)), BS)
    index.record("p1", old)
    index.record("p1", new)
    assert len(index) == 8
    assert index.matched_blocks("p1", new) == 5
    # 10 > 8: two of `old`'s blocks went, its tail first (as the node frees them), its head kept
    assert index.matched_blocks("p1", old) == 3
    index.record("p2", new)
    index.forget_node("p1")
    assert index.matched_blocks("p1", new) == 0 and index.matched_blocks("p2", new) > 0
    with pytest.raises(ValueError):
        PrefixIndex(capacity=0)


def test_cost_prefers_cached_prefix_until_load_outweighs_it() -> None:
    prompt_len = 1000
    holder = prefill_cost(prompt_len, cached_tokens=960, outstanding_tokens=0)
    other = prefill_cost(prompt_len, cached_tokens=0, outstanding_tokens=0)
    assert holder < other
    busy_holder = prefill_cost(prompt_len, cached_tokens=960, outstanding_tokens=4000)
    assert busy_holder > other
    assert prefill_cost(10, cached_tokens=20, outstanding_tokens=-1) == 0.0


def test_a_cached_prefix_is_left_only_for_a_node_less_busy_by_more_than_the_prefix() -> None:
    """The holder of a 960-token prefix, busy with 1000 uncached tokens, still beats an idle
    node that would recompute (and duplicate) the prefix; only past the prefix's size of
    imbalance does the prompt move."""
    n, hit = 1000, 960
    idle_other = prefill_cost(n, cached_tokens=0, outstanding_tokens=0, best_cached_tokens=hit)
    assert idle_other == n + hit
    busy = prefill_cost(n, cached_tokens=hit, outstanding_tokens=1000, best_cached_tokens=hit)
    assert busy < idle_other
    swamped = prefill_cost(n, cached_tokens=hit, outstanding_tokens=2000, best_cached_tokens=hit)
    assert swamped > idle_other


def test_index_mirrors_each_nodes_pool_and_its_reported_evictions() -> None:
    index = PrefixIndex()
    sys_a = prompt_hashes(list(range(64)), BS)  # 4 blocks
    sys_b = prompt_hashes(list(range(500, 564)), BS)
    index.set_capacity("p1", 6)  # the node reported a pool of 6 blocks
    index.record("p1", sys_a)
    index.record("p1", sys_b)  # 8 > 6: the node evicted two blocks of sys_a, tail first
    assert index.matched_blocks("p1", sys_a) == 2 and index.matched_blocks("p1", sys_b) == 4
    assert len(index) == 6
    # p2 reported nothing: the default per-node bound applies
    index.record("p2", sys_a)
    assert index.matched_blocks("p2", sys_a) == 4
    # p2 reports a hit of 1 block where 4 were believed: block 1 was evicted there, and (LRU)
    # every block it held for less long, which includes the rest of that chain's tail
    index.record("p2", sys_b)
    index.correct("p2", sys_a, reported_blocks=1)
    assert index.matched_blocks("p2", sys_a) == 1
    assert index.matched_blocks("p2", sys_b) == 4  # more recent than the evicted block: kept
    index.correct("p2", sys_b, reported_blocks=4)  # as believed: nothing changes
    assert index.matched_blocks("p2", sys_b) == 4


def test_config_rejects_unknown_routing() -> None:
    with pytest.raises(ValueError, match="prefill_routing"):
        DecodeNodeConfig(prefill_targets=("h:1",), prefill_routing="random").validate()


def test_prompt_with_cached_prefix_goes_to_the_node_holding_it(
    checkpoint: Callable[..., Path],
) -> None:
    path = checkpoint("llama")
    bases = random_prompts(4, 512, min_len=160, max_len=160, seed=91)
    tails = random_prompts(4, 512, min_len=20, max_len=20, seed=92)

    async def body() -> None:
        async with pd_cluster(path, num_prefill=2) as c:
            decode = c.decodes[0]
            target = c.targets[0]

            def served_by(rid: str) -> int:
                return next(
                    i for i, p in enumerate(c.prefills) if rid in dict(p.core.recent_history)
                )

            sent = 0  # prompt tokens sent to the prefill nodes
            for i, (base, tail) in enumerate(zip(bases, tails, strict=True)):
                first = await generate(target, base, max_tokens=2, timeout=60)
                longer = [*base, *tail]
                second = await generate(target, longer, max_tokens=3, timeout=60)
                assert second.token_ids == hf_greedy(path, longer, 3), i
                assert served_by(second.request_id) == served_by(first.request_id), i
                reported = decode.transfer_log[second.request_id].cached_tokens
                assert reported == (len(base) // BS) * BS, i
                sent += 2 * len(base) + len(tail)
            reused = sum(r.cached_tokens for r in decode.transfer_log.values())
            m = (await asyncio.to_thread(c.metrics))[:2]  # the prefill nodes'
            cached = sum(x['pdserve_prompt_tokens_total{source="cached"}'] for x in m)
            computed = sum(x['pdserve_prompt_tokens_total{source="computed"}'] for x in m)
            assert cached == reused and computed == sent - reused
            await c.assert_idle_and_conserved()

    with single_torch_thread():
        asyncio.run(body())
