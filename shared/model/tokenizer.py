"""Tokenizers and streaming detokenization.

`encode` adds the tokenizer's special tokens by default (BOS), like a Hugging Face fast tokenizer
built from the same `tokenizer.json`; `decode` skips special tokens by default.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(ABC):
    def __init__(self, bos_token_id: int | None, eos_token_ids: Iterable[int]) -> None:
        self._bos = bos_token_id
        self._eos = frozenset(eos_token_ids)

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer(Tokenizer):
    """Token i < 256 is byte i; ids from 256 up are specials (bos, eos, pad by default)."""

    def __init__(
        self,
        *,
        bos_token_id: int | None = 256,
        eos_token_ids: Iterable[int] = (257,),
        pad_token_id: int | None = 258,
        vocab_size: int = 259,
    ) -> None:
        if vocab_size < 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 256, got {vocab_size}")
        super().__init__(bos_token_id, eos_token_ids)
        self.pad_token_id = pad_token_id
        self._vocab_size = vocab_size
        specials = {t for t in (bos_token_id, pad_token_id, *self._eos) if t is not None}
        self._special_ids = frozenset(specials)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_special_tokens and self._bos is not None:
            ids.insert(0, self._bos)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        # Non-byte ids that are not skipped specials have no text: dropped rather than guessed.
        data = bytes(i for i in ids if 0 <= i < 256)
        text = data.decode("utf-8", errors="replace")
        if skip_special_tokens:
            return text
        return _decode_with_markers(ids, self._special_ids)


def _decode_with_markers(ids: Sequence[int], specials: frozenset[int]) -> str:
    parts: list[str] = []
    run = bytearray()
    for i in ids:
        if 0 <= i < 256:
            run.append(i)
            continue
        parts.append(run.decode("utf-8", errors="replace"))
        run.clear()
        if i in specials:
            parts.append(f"<|{i}|>")
    parts.append(run.decode("utf-8", errors="replace"))
    return "".join(parts)


class HfTokenizer(Tokenizer):
    """A `tokenizer.json` through the `tokenizers` package (no transformers, no network)."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
    ) -> None:
        super().__init__(bos_token_id, eos_token_ids)
        self._tok = tokenizer

    @classmethod
    def from_file(
        cls, path: str | Path, *, bos_token_id: int | None, eos_token_ids: Iterable[int]
    ) -> HfTokenizer:
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception on malformed files
            raise ValueError(f"cannot read tokenizer {path}: {exc}") from exc
        return cls(tok, bos_token_id=bos_token_id, eos_token_ids=eos_token_ids)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (e.g. to save it as tokenizer.json)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing stream of token ids into text deltas, never splitting a character.

    Decodes a short window of recent tokens twice (with and without the newest ones) and emits
    the difference. Decoding the window rather than single tokens keeps context-dependent
    decoders right (SentencePiece's leading-space handling, byte-level merges). A delta ending in
    U+FFFD is held back: it may be a multi-byte character whose remaining bytes are still to
    come. Once later tokens decode to something after it, the replacement character is known to
    be final (the bytes were invalid) and is emitted with them; `flush` emits whatever is held.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        # A few prompt tokens give the first generated token its context (e.g. a leading space).
        self._ids: list[int] = list(prompt_ids[-6:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: Iterable[int]) -> str:
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _decode(self, start: int, end: int) -> str:
        return self._tok.decode(self._ids[start:end]) if end > start else ""
