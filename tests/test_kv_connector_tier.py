"""The KV connector is where a KV tier below the pool plugs in without touching the scheduler:
a host-memory tier (full prompt blocks copied out of one engine's pool, keyed by their prefix
hashes) supplies a fresh engine's prompt through `external_tokens` / `after_allocate` /
`start_load_kv`, and that engine computes only the rest. Greedy output equals the engine that
computed everything; a tier holding wrong bytes changes it (the loaded KV is what is read)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.engine.config import EngineConfig
from shared.engine.connector.base import LayerHook, NoKvConnector
from shared.engine.core import EngineCore
from shared.engine.requests.request import LlmRequest
from shared.engine.resources.block_manager import BlockHash, compute_block_hashes
from shared.engine.resources.resource_manager import KVCacheManager
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.scheduling.scheduler import ScheduledRequest

BS = 8
PROMPT = [(7 * i + 3) % 250 + 3 for i in range(45)]  # five full blocks and a partial one
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


class HostTier(NoKvConnector):
    """Full blocks in host memory by prefix hash; loaded into the pool before the step reads
    them. Nothing is computed that the tier holds."""

    def __init__(self, kv: KVCacheManager, store: dict[BlockHash, torch.Tensor]):
        self.kv, self.store = kv, store
        self.pool: torch.Tensor | None = None
        self.pending: dict[str, tuple[int, list[int]]] = {}  # rid -> (first block, blocks)
        self.loaded_tokens: dict[str, int] = {}
        self.first_step: list[tuple[str, int]] = []

    def register_kv_pool(self, pool: torch.Tensor) -> None:
        self.pool = pool

    def external_tokens(self, request: LlmRequest, local_tokens: int) -> int:
        hashes = compute_block_hashes(request.prompt_token_ids, BS)
        first = local_tokens // BS
        held = 0
        while first + held < len(hashes) and hashes[first + held] in self.store:
            held += 1
        return held * BS

    def after_allocate(self, request: LlmRequest, blocks: Sequence[int]) -> None:
        first = len(self.kv.block_table(request.request_id)) - len(blocks)
        self.pending[request.request_id] = (first, list(blocks))

    def start_load_kv(self, scheduled: Sequence[ScheduledRequest]) -> None:
        assert self.pool is not None
        for s in scheduled:
            rid = s.request.request_id
            if rid not in self.pending:
                continue
            first, blocks = self.pending.pop(rid)
            hashes = compute_block_hashes(s.request.prompt_token_ids, BS)
            for i, block in enumerate(blocks):
                self.pool[:, :, block].copy_(self.store[hashes[first + i]])
            self.loaded_tokens[rid] = len(blocks) * BS
            self.first_step.append((rid, s.num_new_tokens))

    def layer_hook(self, scheduled: Sequence[ScheduledRequest]) -> LayerHook | None:
        return None


@dataclass
class TierSettings(DecodeSettings):
    store: dict[BlockHash, torch.Tensor] = field(default_factory=dict)
    tier: HostTier | None = field(default=None, init=False)

    def connector(self, kv: KVCacheManager) -> HostTier:  # type: ignore[override]
        self.tier = HostTier(kv, self.store)
        return self.tier


def config() -> EngineConfig:
    return EngineConfig(model="tiny", block_size=BS, num_kv_blocks=64, max_batch_size=4)


def run(core: EngineCore, rid: str) -> list[int]:
    core.add_request(PROMPT, GREEDY, rid)
    tokens: list[int] = []
    while core.has_work:
        for delta in core.step():
            tokens.extend(delta.token_ids)
    core.check_conservation()
    return tokens


def offloaded() -> tuple[list[int], dict[BlockHash, torch.Tensor]]:
    """Greedy tokens of an engine that computes everything, and its prompt's full blocks copied
    out to host memory (what an offload tier keeps when the pool evicts them)."""
    core = EngineCore(config(), role=DecodeSettings())
    core.add_request(PROMPT, GREEDY, "src")
    core.step()  # the prompt (under the step's token budget) is computed and cached
    table = core.kv_manager.block_table("src")
    hashes = compute_block_hashes(PROMPT, BS)
    store = {h: core.kv_pool[:, :, table[i]].clone() for i, h in enumerate(hashes)}
    tokens = list(core.requests["src"].output_token_ids)
    while core.has_work:
        for delta in core.step():
            tokens.extend(delta.token_ids)
    core.check_conservation()
    return tokens, store


def test_a_tier_below_the_pool_supplies_the_prompt_through_the_connector() -> None:
    want, store = offloaded()
    settings = TierSettings(store=store)
    core = EngineCore(config(), role=settings)
    assert run(core, "r") == want
    tier = settings.tier
    assert tier is not None
    # five full blocks came from the tier; only the partial last block's 5 tokens were computed
    assert tier.loaded_tokens == {"r": 40}
    assert tier.first_step == [("r", 5)]
    assert core.kv_manager.blocks.num_pinned_blocks == 0


def test_the_loaded_bytes_are_what_the_model_reads() -> None:
    want, store = offloaded()
    wrong = {h: torch.randn_like(block) for h, block in store.items()}
    core = EngineCore(config(), role=TierSettings(store=wrong))
    assert run(core, "r") != want
