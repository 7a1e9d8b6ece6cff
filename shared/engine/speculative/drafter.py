"""Speculative decoding's two halves around one forward: drafts proposed for the requests that
can take them before the step is scheduled, and the step's logits verified after it.

A request with drafts d1..dk computes its last token and the drafts in one step; the logits at
each of those k + 1 positions say what the model itself would emit next. The sampler draws the
first position as on any step and each further one as the step of its own it stands for (the
same seeded stream at the next output index: `Sampler.draw_drafts`); a draw is kept while the
draw before it equals the draft there, and the first draw that differs (or the bonus draw after
the last draft) ends the step's tokens. A draw is a pure function of (logits, seed, output
index), so greedy and seeded sampling both give exactly the tokens of one-token steps: for a
deterministic draft this is rejection sampling with the draft's probability one, whose output
distribution is the model's.

Requests with penalties, logit bias, min_tokens or a grammar are not drafted for (their next
draw depends on state each token changes); they run one token a step beside drafted ones,
unchanged. Drafting stops where it does not pay: in batches larger than `max_batch` (a CPU step
that is compute-bound pays for every verified token) and for a request whose recent drafts were
mostly rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.engine.requests.request import LlmRequest, LlmRequestState
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.engine.speculative.config import SpeculativeConfig
from shared.engine.speculative.draft_model import MAX_DRAFT_BATCH
from shared.engine.speculative.proposer import Proposer

MAX_BATCH = MAX_DRAFT_BATCH  # drafting stops above this many running requests
MIN_ACCEPTANCE = 0.25  # a request whose recent drafts were accepted less often rests
REST_STEPS = 16  # how long it rests before drafting again


def draftable(request: LlmRequest) -> bool:
    p = request.sampling_params
    return (
        request.state == LlmRequestState.GENERATION_IN_PROGRESS
        and not p.has_penalties
        and p.structured is None
    )


@dataclass
class _Record:
    """A request's recent drafting: an EWMA of the accepted share, and steps left at rest."""

    acceptance: float = 1.0
    rest: int = 0


class Drafter:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_batch: int = MAX_BATCH):
        config.validate()
        self.config = config
        self.proposer = proposer
        self.max_batch = max_batch
        self.proposed = 0  # drafts proposed since start
        self.accepted = 0  # of them, accepted
        self.steps = 0  # verifying steps of a request
        self.tokens = 0  # tokens those steps yielded
        self._records: dict[str, _Record] = {}  # live requests' (bounded by the batch)

    def propose(self, running: list[LlmRequest]) -> None:
        """Drafts for the running requests that can take them (at most what their max_tokens
        leaves after this step's own token); none for the rest."""
        live = {r.request_id for r in running}
        for rid in [rid for rid in self._records if rid not in live]:
            del self._records[rid]
        small = len(running) <= self.max_batch
        wanted: list[tuple[LlmRequest, int]] = []
        for request in running:
            request.draft_token_ids = []
            if not small or not draftable(request) or not self._awake(request.request_id):
                continue
            if request.num_tokens - request.num_computed_tokens != 1:
                continue
            room = request.sampling_params.max_tokens - len(request.output_token_ids) - 1
            k = min(self.config.num_speculative_tokens, room)
            if k > 0:
                wanted.append((request, k))
        if wanted:
            for (request, _), drafts in zip(wanted, self.proposer.propose(wanted), strict=True):
                request.draft_token_ids = drafts

    def _awake(self, request_id: str) -> bool:
        record = self._records.get(request_id)
        if record is None or record.rest == 0:
            return True
        record.rest -= 1
        return False

    def accept(
        self,
        request: LlmRequest,
        first: tuple[int, TokenLogprobs | None],
        drawn: Sequence[tuple[int, TokenLogprobs | None]],
    ) -> list[tuple[int, TokenLogprobs | None]]:
        """The step's tokens (with their logprobs) for `request`: `first`, the draw after its
        last token, then `drawn[j]` (the draw after draft j + 1) while the token before it
        equals that draft."""
        drafts = request.draft_token_ids
        out = [first]
        for draft, after in zip(drafts, drawn, strict=True):
            if out[-1][0] != draft:
                break
            out.append(after)
        if drafts:
            self._count(request.request_id, len(drafts), len(out) - 1)
        return out

    def verify(
        self,
        request: LlmRequest,
        first: tuple[int, TokenLogprobs | None],
        drawn: tuple[list[int], list[TokenLogprobs | None]],
    ) -> list[tuple[int, TokenLogprobs | None]]:
        """`accept`, from the sampler's draws (tokens, logprobs) for the drafts' rows; the
        accepted drafts' K/V, computed this step, counts from now."""
        step = self.accept(request, first, list(zip(*drawn, strict=True)))
        request.num_computed_tokens += len(step) - 1
        request.draft_token_ids = []
        return step

    def _count(self, request_id: str, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
        self.tokens += accepted + 1
        record = self._records.setdefault(request_id, _Record())
        record.acceptance = 0.7 * record.acceptance + 0.3 * (accepted / proposed)
        if record.acceptance < MIN_ACCEPTANCE:
            record.rest, record.acceptance = REST_STEPS, MIN_ACCEPTANCE
