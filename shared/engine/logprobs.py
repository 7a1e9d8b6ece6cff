"""Logprobs of the model's raw distribution: log_softmax of the logits, before logit_bias,
penalties, temperature, top-k and top-p (vLLM's default), for sampled and prompt tokens.

One batched pass per step: the rows that asked for logprobs are gathered, normalised once and
their top-k taken with the largest k any of them asked for; each row then keeps its own k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shared.engine.scheduler import ScheduledRequest


@dataclass
class TokenLogprobs:
    """One position: the token there, its logprob, and the top-k alternatives (most likely
    first; the token itself appears among them when it is in the top k)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def compute_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], top_k: Sequence[int]
) -> list[TokenLogprobs]:
    """logits: [rows, vocab]; token_ids[i]: the token whose logprob row i reports; top_k[i]:
    how many alternatives row i wants (0 = only the token's own)."""
    if not token_ids:
        return []
    logits = logits.float()
    # log_softmax(x)[t] = x[t] - logsumexp(x): one reduction, no [rows, vocab] result written
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [rows, 1]
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    chosen = (logits.gather(1, ids[:, None]) - lse).flatten().tolist()  # [rows]
    k_max = max(top_k)
    top_vals: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if k_max > 0:
        values, indices = logits.topk(k_max, dim=-1)  # [rows, k_max], descending
        top_vals, top_ids = (values - lse).tolist(), indices.tolist()
    return [
        TokenLogprobs(t, lp, list(zip(top_ids[i][:k], top_vals[i][:k], strict=True)))
        for i, (t, lp, k) in enumerate(zip(token_ids, chosen, top_k, strict=True))
    ]


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
