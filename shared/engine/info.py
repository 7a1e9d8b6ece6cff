"""What a node may read about its engine without a command: facts fixed when the engine is
built (the model, its limits, the KV layout and the pool's memory), safe from any thread."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.requests.multimodal import MultimodalPrompt, PromptImage
from shared.engine.requests.request_limits import RequestLimits
from shared.engine.resources.block_manager import BlockHash, lora_seed
from shared.engine.runtime.kv_budget import PoolSize
from shared.engine.sampling.sampling_params import SamplingParams
from shared.kv.layout import KvLayout
from shared.model.loader import LoadedModel
from shared.model.lora_adapter import LoraAdapter
from shared.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineInfo:
    loaded: LoadedModel  # name, chat template, generation defaults, tokenizer
    architecture: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    num_offload_blocks: int  # kept below the pool by its offload tiers (the connector's)
    layout: KvLayout
    # the pool's memory, for the transfer plane to register with UCX; never read or written
    # outside the engine thread except by the KV transfer into blocks the engine reserved
    kv_pool: torch.Tensor
    device_type: str  # "cpu" or "cuda"
    limits: RequestLimits
    pool_size: PoolSize  # the pool's blocks and tokens, and what sized it (/version says)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def pool_tokens(self) -> int:
        """Tokens the whole KV pool holds: a default max_tokens must fit it too."""
        return self.num_kv_blocks * self.block_size

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestRejected naming the field; nothing is allocated before this passes."""
        self.limits.check(prompt_token_ids, params)

    def multimodal(
        self, prompt: list[int], images: Sequence[PromptImage]
    ) -> MultimodalPrompt | None:
        """The prompt's images laid out: how the prefix cache keys their placeholders, the
        mRoPE delta after the prompt (RequestRejected when placeholders and images disagree);
        None for a text prompt."""
        return self.limits.multimodal(prompt, images)

    def kv_seed(self, adapter: str | None) -> BlockHash:
        """Where the prefix hashes of a request of `adapter` start: its name and files."""
        if adapter is None:
            return b""
        bank = self.loaded.model.lora  # read in place: this runs as requests' blocks fill
        found = None if bank is None else bank.adapters.get(adapter)
        return lora_seed(adapter, b"" if found is None else found.fingerprint)

    @property
    def lora_adapters(self) -> dict[str, LoraAdapter]:
        """The adapters the model serves now, by name (--lora-modules)."""
        bank = self.loaded.model.lora
        return {} if bank is None else dict(bank.adapters)
