"""Speculative decoding's two halves around one forward: drafts proposed for the requests that
can take them before the step is scheduled, and the step's logits verified after it.

A request with drafts d1..dk computes its last token and the drafts in one step; the logits at
each of those k + 1 positions say what the model itself would emit next. The sampler draws the
first position as on any step; each further position is accepted while the previous draw equals
the draft there, and the first draw that differs (or the bonus draw after the last draft) ends
the step's tokens. Greedy draws are argmax, so the tokens are exactly those of one-token steps.

Only plainly greedy requests are drafted for: temperature 0, no penalties, no logit bias or
min_tokens, no grammar, no logprobs, n = 1. Every other request runs one token a step beside
them, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shared.engine.requests.request import LlmRequest, LlmRequestState
from shared.engine.speculative import ngram
from shared.engine.speculative.config import SpeculativeConfig


def draftable(request: LlmRequest) -> bool:
    p = request.sampling_params
    return (
        request.state == LlmRequestState.GENERATION_IN_PROGRESS
        and p.greedy
        and not p.has_penalties
        and p.structured is None
        and p.logprobs is None
        and p.prompt_logprobs is None
        and p.n == 1
    )


class Drafter:
    def __init__(self, config: SpeculativeConfig):
        config.validate()
        self.config = config
        self.proposed = 0  # drafts proposed since start
        self.accepted = 0  # of them, accepted

    def propose(self, running: Iterable[LlmRequest]) -> None:
        """Drafts for the running requests that can take them (at most what their max_tokens
        leaves after this step's own token); none for the rest."""
        c = self.config
        for request in running:
            request.draft_token_ids = []
            if not draftable(request) or request.num_tokens - request.num_computed_tokens != 1:
                continue
            room = request.sampling_params.max_tokens - len(request.output_token_ids) - 1
            k = min(c.num_speculative_tokens, room)
            if k <= 0:
                continue
            tokens = request.all_token_ids
            request.draft_token_ids = ngram.propose(
                tokens, k, c.prompt_lookup_min, c.prompt_lookup_max
            )

    def verify(self, request: LlmRequest, first: int, logits: torch.Tensor) -> list[int]:
        """The step's tokens for `request`: `first` (the sampler's draw after its last token),
        then the argmax at each draft's position while the previous token equals its draft.
        `logits`: [k, vocab], row j the logits after draft j + 1."""
        drafts = request.draft_token_ids
        tokens = [first]
        if drafts:
            greedy = logits.max(dim=-1).indices.tolist()
            for draft, after in zip(drafts, greedy, strict=True):
                if tokens[-1] != draft:
                    break
                tokens.append(after)
            self.proposed += len(drafts)
            self.accepted += len(tokens) - 1
        return tokens
