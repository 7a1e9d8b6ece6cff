"""KV offload tiers (shared/engine/connector/offload.py) on a real engine: prompts that outgrow
the pool evict earlier conversations' prefixes, which come back from host memory (or disk)
instead of being recomputed; greedy output is the same with the tiers on and off, and every
block and host slot is back after each scenario."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.engine.config import EngineConfig
from shared.engine.connector.multi import MultiConnector
from shared.engine.connector.offload import OffloadConnector, offload_tier
from shared.engine.connector.offload_config import OffloadConfig
from shared.engine.core import EngineCore
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.roles.prefill_role import PrefillSettings
from shared.engine.sampling.sampling_params import SamplingParams

BS = 8
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
MIB = 1 << 20


def conversation(seed: int, n: int = 60) -> list[int]:
    return [(seed * 31 + 7 * i) % 240 + 5 for i in range(n)]


# three 60-token histories against a 24-block (192-token) pool: each evicts the one before it
# twice over, then the first comes back with a new turn appended
TURNS = [conversation(1), conversation(2), conversation(3), conversation(4), [*conversation(1), 9]]


def config(blocks: int = 24) -> EngineConfig:
    return EngineConfig(model="tiny", block_size=BS, num_kv_blocks=blocks, max_batch_size=2)


def offload(tmp: Path | None = None, cpu_mib: float = 4.0) -> OffloadConfig:
    disk = str(tmp) if tmp is not None else ""
    return OffloadConfig(int(cpu_mib * MIB), disk, 16 * MIB if tmp else 0, model_id="tiny")


def tier_of(core: EngineCore) -> OffloadConnector:
    assert isinstance(core.connector, MultiConnector)
    tier = offload_tier(core.connector)
    assert tier is not None
    return tier


class Counted:
    """Prompt tokens each turn computed (what the forward was given), one engine."""

    def __init__(self, core: EngineCore):
        self.core, self.tokens = core, 0
        forward = core.runner.forward

        def counting(scheduled, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.tokens += sum(s.num_new_tokens for s in scheduled)
            return forward(scheduled, *args, **kwargs)

        core.runner.forward = counting  # type: ignore[method-assign]


def run_turns(
    core: EngineCore, turns: list[list[int]], pushed: bool = False
) -> tuple[list[list[int]], list[int]]:
    """Each turn alone (finished before the next): its greedy tokens and cached_tokens.
    `pushed`: a prefill node's engine, whose node reports each push over."""
    outputs, cached = [], []
    for i, prompt in enumerate(turns):
        rid = f"t{i}"
        request = core.add_request(prompt, GREEDY, rid)
        tokens: list[int] = []
        while core.has_work:
            for delta in core.step():
                tokens.extend(delta.token_ids)
        if pushed:
            core.role.complete_context(rid, True)  # type: ignore[attr-defined]
        outputs.append(tokens)
        cached.append(request.cached_tokens)
        core.check_conservation()
        if isinstance(core.connector, MultiConnector):
            tier_of(core).check_conservation()
    return outputs, cached


def test_an_evicted_prefix_comes_back_from_host_memory_with_the_same_output() -> None:
    off = EngineCore(config(), role=DecodeSettings())
    off_count = Counted(off)
    want, off_cached = run_turns(off, TURNS)
    on = EngineCore(config(), role=DecodeSettings(offload=offload()))
    on_count = Counted(on)
    got, on_cached = run_turns(on, TURNS)
    assert got == want
    tier = tier_of(on)
    # without the tier most of the first conversation was evicted (its tail blocks first)
    assert off_cached[-1] == 16
    # with it, seven full blocks are reused: two from the pool, five loaded back
    assert on_cached[-1] == 56
    assert tier.stats.loaded_blocks == 5 and tier.stats.host_hit_blocks == 5
    assert tier.stats.offloaded_blocks >= 5
    assert on_count.tokens == off_count.tokens - 40


def test_the_tier_is_bounded_and_a_block_too_many_is_recomputed() -> None:
    """A tier of 3 blocks keeps only the last three evicted (the first conversation's blocks
    2-4, after the two the pool kept): those are loaded, blocks 5 and 6 recomputed."""
    core = EngineCore(config(), role=DecodeSettings())
    block_bytes = core.kv_pool.select(2, 0).numel() * core.kv_pool.element_size()
    small = EngineCore(
        config(), role=DecodeSettings(offload=offload(cpu_mib=3 * block_bytes / MIB))
    )
    want, _ = run_turns(core, TURNS)
    got, cached = run_turns(small, TURNS)
    assert got == want
    tier = tier_of(small)
    assert tier.host is not None and len(tier.host) == 3
    assert cached[-1] == 40 and tier.stats.loaded_blocks == 3


def test_a_prefill_node_reloads_its_evicted_prefixes() -> None:
    """A prefill node's engine (context only, its push connector composed with the tier)."""
    off = EngineCore(config(), role=PrefillSettings())
    on = EngineCore(config(), role=PrefillSettings(offload=offload()))
    want, _ = run_turns(off, TURNS, pushed=True)
    got, cached = run_turns(on, TURNS, pushed=True)
    assert got == want
    # here the pool evicted the conversation's first five blocks (its hit is 0): all five come
    # back from the tier, and so do the two after them: still in the pool but past a gap,
    # their copies went down in the background when the first turn released them
    assert cached[-1] == 56 and tier_of(on).stats.loaded_blocks == 7


def test_keys_differ_across_configurations(tmp_path: Path) -> None:
    """Another model id (or block size, dtype, layout) never reads these blocks."""
    first = EngineCore(config(), role=DecodeSettings(offload=offload(tmp_path)))
    run_turns(first, TURNS[:4])
    tier = tier_of(first)
    assert tier.disk is not None
    tier.host.slots  # noqa: B018  (the host tier exists)
    other = OffloadConfig(4 * MIB, str(tmp_path), 16 * MIB, model_id="another")
    second = EngineCore(config(), role=DecodeSettings(offload=other))
    _, cached = run_turns(second, TURNS[4:])
    assert cached == [0]  # a fresh pool, and nothing of the other model's tier


def test_a_host_tier_larger_than_free_memory_is_refused_at_start() -> None:
    too_big = OffloadConfig(1 << 50, model_id="tiny")
    with pytest.raises(ValueError, match=r"--kv-offload-cpu-gb 1\.04858e\+06 is more than"):
        EngineCore(config(), role=DecodeSettings(offload=too_big))


def test_offload_config_is_checked() -> None:
    with pytest.raises(ValueError, match="needs --kv-offload-cpu-gb"):
        OffloadConfig(0, "/tmp/x", MIB).validate()
    with pytest.raises(ValueError, match="go together"):
        OffloadConfig(MIB, "/tmp/x", 0).validate()


def test_a_decode_node_lands_pushes_and_reloads_its_own_prompts() -> None:
    """The decode engine's composed connector: a prompt a prefill node computes lands in the
    blocks the landing connector reserved (finish_load goes to it, not to the tier), while the
    prompts prefilled here go through the tier; the pushed prompt's blocks, evicted later, come
    back from the tier too."""
    from tests.pd_steps import reserve_now

    remote = conversation(9)
    want, _ = run_turns(EngineCore(config(), role=DecodeSettings()), [remote, *TURNS[1:4]])
    core = EngineCore(config(), role=DecodeSettings(offload=offload()))
    _, blocks, first_block = reserve_now(core, remote, GREEDY, "r")
    assert first_block == 0
    reference = EngineCore(config(), role=DecodeSettings())
    reference.add_request(remote, GREEDY, "ref")
    reference.step()  # the whole prompt computed (and its first token sampled)
    table = reference.kv_manager.block_table("ref")
    for mine, theirs in zip(blocks, table, strict=False):
        core.kv_pool[:, :, mine].copy_(reference.kv_pool[:, :, theirs])  # as the receiver does
    token = reference.requests["ref"].output_token_ids[0]
    landed = core.role.complete_transfer("r", token)  # type: ignore[attr-defined]
    got = [t for d in landed for t in d.token_ids]
    while core.has_work:
        for delta in core.step():
            got.extend(delta.token_ids)
    core.check_conservation()
    tier_of(core).check_conservation()
    assert got == want[0]
    # three more conversations evict the landed prompt's blocks to the tier; it comes back
    outputs, cached = run_turns(core, [*TURNS[1:4], [*remote, 9]])
    assert outputs[:3] == want[1:4]
    assert cached[-1] == 56 and tier_of(core).stats.loaded_blocks > 0
