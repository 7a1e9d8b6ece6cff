"""Prompt logprobs, filled from a step's every-token logits (a request that asks for them
computes its whole prompt: no prefix-cache hit)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.engine.sampling.logprobs import TokenLogprobs, compute_logprobs
from shared.engine.scheduling.scheduler import ScheduledRequest


def fill_prompt_logprobs(scheduled: Sequence[ScheduledRequest], logits: torch.Tensor) -> None:
    """Fill the prompt logprobs of this step's requests that still need them, from every new
    token's logits [num_tokens, vocab] (rows in batch order; counters not yet advanced).

    Position p's logits predict token p + 1, so entry t of a chunk starting at position
    `start` in row `row` comes from row `row + t - 1 - start`; entries already filled are kept
    (a preempted request recomputes its prompt)."""
    rows: list[int] = []
    targets: list[tuple[list[TokenLogprobs | None], int]] = []
    ids: list[int] = []
    ks: list[int] = []
    row = 0
    for s in scheduled:
        r, start, count = s.request, s.request.num_computed_tokens, s.num_new_tokens
        entries = r.prompt_logprobs
        if entries is not None and r.needs_prompt_logits:
            for t in range(start + 1, min(start + count + 1, r.prompt_len)):
                if entries[t] is None:
                    rows.append(row + t - 1 - start)
                    targets.append((entries, t))
                    ids.append(r.prompt_token_ids[t])
                    ks.append(r.sampling_params.prompt_logprobs or 0)
        row += count
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    for (entries, t), lp in zip(targets, compute_logprobs(logits[index], ids, ks), strict=True):
        entries[t] = lp
