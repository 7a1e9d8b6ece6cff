"""Who proposes a step's drafts: the seam between the drafting policy (drafter.py: which
requests, how many tokens) and the method. A proposer returns each asked request's drafts (up to
its k, possibly none); verification never depends on how they were made, so a method only
changes how many are accepted. An EAGLE or MTP head would be one more proposer, reading the
target's hidden states where these read tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from shared.engine.requests.request import LlmRequest
from shared.engine.speculative import ngram
from shared.engine.speculative.config import SpeculativeConfig
from shared.engine.speculative.draft_model import DraftEngine, DraftModelProposer


class Proposer(Protocol):
    def propose(self, wanted: Sequence[tuple[LlmRequest, int]]) -> list[list[int]]:
        """For each (request, k): at most k tokens likely to follow the request's tokens."""
        ...


class NgramProposer:
    """Prompt lookup: the request's own tokens (ngram.py)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, wanted: Sequence[tuple[LlmRequest, int]]) -> list[list[int]]:
        return [
            ngram.propose(request.all_token_ids, k, self.min_n, self.max_n) for request, k in wanted
        ]


def build_proposer(spec: SpeculativeConfig, draft_engine: Callable[[], DraftEngine]) -> Proposer:
    """The proposer of `spec.method`; `draft_engine` builds the draft model's engine (only the
    draft_model method calls it)."""
    if spec.method == "draft_model":
        return DraftModelProposer(draft_engine())
    return NgramProposer(spec)
