"""The shared-prefix workload generator and the one-shared-cache replay of
`pdserve bench serve --workload shared-prefix`: pure functions, checked without any node."""

from __future__ import annotations

import itertools

import pytest

from pdserve.bench.support.prefix_cache_sim import replay_shared_cache
from pdserve.bench.support.workloads import SharedPrefixConfig, shared_prefix_requests

CONFIG = SharedPrefixConfig(
    num_requests=30,
    num_system_prompts=3,
    system_prompt_len=40,
    user_len=8,
    num_conversations=4,
    turns=3,
    answer_len=5,
)


def test_sizes_and_counts() -> None:
    reqs = shared_prefix_requests(CONFIG, vocab=100, seed=0)
    assert len(reqs) == 30
    users = [r for r in reqs if r.kind == "user"]
    convs = [r for r in reqs if r.kind == "conversation"]
    assert len(users) == CONFIG.num_users == 30 - 4 * 3 and len(convs) == 12
    assert all(len(r.prompt) == 40 + 8 for r in users)
    for r in convs:
        assert len(r.prompt) == 40 + 8 + (r.turn - 1) * (5 + 8)
    assert max(len(r.prompt) for r in reqs) == CONFIG.max_prompt_len()
    assert all(0 <= t < 100 for r in reqs for t in r.prompt)


def test_sharing_structure() -> None:
    reqs = shared_prefix_requests(CONFIG, vocab=100, seed=1)
    systems: dict[int, list[int]] = {}
    for r in reqs:  # every request starts with its system prompt, the same one for all its users
        systems.setdefault(r.system_prompt, r.prompt[:40])
        assert r.prompt[:40] == systems[r.system_prompt]
    assert len(systems) == 3 and len({tuple(s) for s in systems.values()}) == 3
    users = [r for r in reqs if r.kind == "user"]
    assert len({tuple(r.prompt[40:]) for r in users}) == len(users)  # user parts differ
    for c in range(4):
        turns = [r for r in reqs if r.conversation == c]
        assert [r.turn for r in turns] == [1, 2, 3]  # in arrival order
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.prompt[: len(prev.prompt)] == prev.prompt  # the previous turn is its prefix
            # a round apart: every other conversation's turn comes in between
            between = reqs[reqs.index(prev) + 1 : reqs.index(nxt)]
            assert sum(r.kind == "conversation" for r in between) == 3


def test_deterministic_from_seed() -> None:
    a = shared_prefix_requests(CONFIG, vocab=100, seed=7)
    assert a == shared_prefix_requests(CONFIG, vocab=100, seed=7)
    assert a != shared_prefix_requests(CONFIG, vocab=100, seed=8)


def test_config_rejects_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="num_conversations"):
        SharedPrefixConfig(num_requests=5, num_conversations=2, turns=3)
    with pytest.raises(ValueError, match="system_prompt_len"):
        SharedPrefixConfig(num_requests=5, system_prompt_len=0, num_conversations=0)


def test_replay_counts_leading_cached_blocks() -> None:
    sys_prompt = list(range(32))  # two blocks of 16
    a, b = [*sys_prompt, *range(100, 110)], [*sys_prompt, *range(200, 210)]
    replay = replay_shared_cache([a, b, a], block_size=16, capacity_blocks=100)
    # a: all computed; b: the 2 system blocks cached; a again: its 2 full blocks (the 10-token
    # tail is no full block)
    assert (replay.cached_tokens, replay.computed_tokens) == (64, 42 + 10 + 10)
    assert replay.hit_rate == pytest.approx(64 / 126)


def test_replay_never_reuses_the_last_token() -> None:
    p = list(range(32))  # exactly two full blocks: the second holds the last token
    replay = replay_shared_cache([p, p], block_size=16, capacity_blocks=10)
    assert replay.cached_tokens == 16 and replay.computed_tokens == 32 + 16


def test_replay_evicts_least_recently_used() -> None:
    x, y, z = ([k * 1000 + i for i in range(33)] for k in range(3))  # 2 full blocks each
    # capacity 4: x, y fill it; x touched again; z evicts y (the LRU), so y misses and x hits
    replay = replay_shared_cache([x, y, x, z, x, y], block_size=16, capacity_blocks=4)
    hits = [32 * h for h in (0, 0, 1, 0, 1, 0)]
    assert replay.cached_tokens == sum(hits)
    assert replay_shared_cache([x, x], 16, capacity_blocks=0).cached_tokens == 0


def test_replay_evicts_a_chain_tail_first() -> None:
    p = [*range(48), 999]  # 3 full blocks; capacity 2 keeps the first two (tail released first)
    assert replay_shared_cache([p, p], block_size=16, capacity_blocks=2).cached_tokens == 32
