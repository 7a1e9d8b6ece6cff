"""Drafts from a smaller model with the same tokenizer, run as an engine of its own.

The draft model's engine (its own weights, KV pool and prefix cache, built by the target engine
from `--speculative-config`'s `model`) takes each drafted request as a greedy request of k tokens
over the target request's tokens so far, runs until all are done, and frees them. Its prefix
cache keeps what earlier steps computed, so a step costs the draft model the tokens accepted
since the last one (and the last partial block), then k one-token steps for the whole batch at
once. On a P/D decode node the draft model's prompt KV is therefore computed there, on the first
drafted step: the draft model is small, so its prompt costs little next to moving its KV from a
prefill node that would have to load it too.

Greedy drafts are deterministic, so verification (drafter.py) keeps the target's distribution
whatever the draft model proposes: a poor one only lowers acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from shared.engine.config import EngineConfig
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import LlmRequest
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.speculative.config import SpeculativeConfig
from shared.model.loader import LoadedModel

# text both tokenizers must split alike (words, digits, punctuation, whitespace, non-ASCII)
_PROBE = 'The draft model\'s tokenizer: 12,345 tokens; naïve café — 東京 {"a": [1, 2]}\n\t end'


MAX_DRAFT_BATCH = 8  # requests drafted for at once at most (drafter.py's MAX_BATCH)


def draft_config(target: EngineConfig, spec: SpeculativeConfig, num_blocks: int) -> EngineConfig:
    """The draft model's engine: the target's settings with its own model, as many pool blocks
    as the target's (it is the smaller model), no adapters and no drafting of its own."""
    return replace(
        target,
        model=spec.model,
        speculative=None,
        num_kv_blocks=num_blocks,
        max_batch_size=MAX_DRAFT_BATCH,
        max_model_len=0,
        lora_modules=(),
        max_loras=0,
    )


class DraftEngine(Protocol):
    """What the proposer drives: an engine core of the draft model (shared/engine/core.py)."""

    max_model_len: int

    @property
    def has_work(self) -> bool: ...

    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str = ""
    ) -> LlmRequest: ...

    def step(self) -> list[TokenDelta]: ...


class DraftModelProposer:
    def __init__(self, engine: DraftEngine):
        self.engine = engine
        self._serial = 0  # draft request ids: one per drafted request per step

    def propose(self, wanted: Sequence[tuple[LlmRequest, int]]) -> list[list[int]]:
        ids: list[str | None] = []
        for request, k in wanted:
            tokens = request.all_token_ids
            if len(tokens) + k > self.engine.max_model_len:
                ids.append(None)  # past the draft model's context: this request goes undrafted
                continue
            self._serial += 1
            rid = f"draft-{self._serial}"
            params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
            self.engine.add_request(tokens, params, rid)
            ids.append(rid)
        drafts: dict[str, list[int]] = {rid: [] for rid in ids if rid is not None}
        # bounded: every draft request ends after its k tokens
        while self.engine.has_work:
            for delta in self.engine.step():
                drafts[delta.request_id].extend(delta.token_ids)
        return [[] if rid is None else drafts[rid] for rid in ids]


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model proposes token ids the target must read as the same text: refuse at start
    one whose tokenizer differs (size or how it splits a probe text)."""
    t, d = target.tokenizer, draft.tokenizer
    if t.vocab_size != d.vocab_size or t.encode(_PROBE) != d.encode(_PROBE):
        raise ValueError(
            f"speculative draft model {draft.name!r} does not share the tokenizer of "
            f"{target.name!r} ({d.vocab_size} against {t.vocab_size} tokens): a draft model "
            "must use the served model's tokenizer"
        )
