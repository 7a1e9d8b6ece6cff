"""Prompt lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence of the
request's own last n tokens, longest n first. No model, no state: a pure function of the
tokens, so a draft never depends on which node or step proposes it."""

from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier match of the longest suffix n-gram
    (`max_n` down to `min_n`) of `tokens`; [] when none matches."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n :])
        # the latest earlier start whose n tokens equal the suffix (the suffix itself excluded)
        for start in range(length - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return list(follow)
    return []
