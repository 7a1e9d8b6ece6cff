"""Logprobs of the model's raw distribution: log_softmax of the logits, before logit_bias,
penalties, temperature, top-k and top-p (vLLM's default), for sampled and prompt tokens.

One batched pass per step: the rows that asked for logprobs are gathered, normalised once and
their top-k taken with the largest k any of them asked for; each row then keeps its own k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


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
