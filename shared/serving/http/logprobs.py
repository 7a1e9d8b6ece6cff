"""The engine's logprobs in OpenAI's shapes (legacy completions, chat) and vLLM's
`prompt_logprobs`.

Token text is the token id decoded alone with the model's tokenizer (specials kept), as vLLM
does; a byte-level token that is only part of a UTF-8 character decodes to U+FFFD, and `bytes`
are those of that text. Logprobs are those of the model's raw distribution (before temperature,
penalties, logit_bias, top-k, top-p). JSON has no -inf: values are floored at -9999.0 (vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.engine.sampling.logprobs import TokenLogprobs
from shared.model.tokenizer import Tokenizer

FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, FLOOR)


class TokenTexts:
    """Token id -> its text decoded alone; cached (the vocabulary is bounded, traffic is not)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


class CompletionLogprobsWriter:
    """One choice's legacy `logprobs` object, built piece by piece: `text_offset` runs over
    the choice's token texts (echoed prompt first), the same whether streamed or not."""

    def __init__(self, texts: TokenTexts, k: int) -> None:
        self.texts, self.k, self.offset = texts, k, 0

    def shape(self, entries: Sequence[tuple[int, TokenLogprobs | None]]) -> dict[str, Any]:
        """entries: (token id, its logprobs or None: the first prompt token has none)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, lp in entries:
            text = self.texts(token_id)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if lp is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_lp(lp.logprob))
            top = lp.top[: self.k]
            alternatives = {self.texts(t): _lp(v) for t, v in top}
            # OpenAI: the chosen token is always there, so up to k + 1 entries
            if all(t != token_id for t, _ in top):
                alternatives.setdefault(text, _lp(lp.logprob))
            top_logprobs.append(alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }


def _top(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    text = texts(token_id)
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_content(
    texts: TokenTexts, entries: Sequence[TokenLogprobs], k: int
) -> list[dict[str, Any]]:
    """Chat's `logprobs.content`: per token its text, logprob, bytes and the top k, most
    likely first."""
    return [
        {
            **_top(texts, lp.token_id, lp.logprob),
            "top_logprobs": [_top(texts, t, v) for t, v in lp.top[:k]],
        }
        for lp in entries
    ]


def prompt_logprobs_shape(
    texts: TokenTexts, prompt: Sequence[int], entries: Sequence[TokenLogprobs | None], k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token {token id: {logprob, rank, decoded_token}}
    for the token itself and the top k; the first token has none (null)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, lp in zip(prompt, entries, strict=True):
        if lp is None:
            out.append(None)
            continue
        ranks = {t: r for r, (t, _) in enumerate(lp.top, 1)}
        entry = {
            str(token_id): {
                "logprob": _lp(lp.logprob),
                "rank": ranks.get(token_id),
                "decoded_token": texts(token_id),
            }
        }
        for rank, (t, v) in enumerate(lp.top[:k], 1):
            entry.setdefault(str(t), {"logprob": _lp(v), "rank": rank, "decoded_token": texts(t)})
        out.append(entry)
    return out
