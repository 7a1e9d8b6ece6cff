"""A `tokenizers.Tokenizer` built from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no `tokenizer.json`, only the vocabulary, merges, scores, token types and special
ids under llama.cpp's keys. This rebuilds the tokenizer transformers builds from the same keys
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), so both encode and decode alike:

- `gpt2`: byte-level BPE over the file's merges, GPT-2's byte-level pre-tokenizer (or the split
  regex named by `tokenizer.ggml.pre` for the vocabularies that need one) and decoder;
- `llama`: SentencePiece-style BPE with byte fallback, `▁` for spaces (prepended to the first
  word), merges from the file or recovered from the token scores as sentencepiece ranks them.

Tokens typed CONTROL (and the bos/eos/unk/pad tokens) become special added tokens, USER_DEFINED
ones plain added tokens, so both are matched whole. BOS is added when `add_bos_token` says so
(llama vocabularies default to yes, like llama.cpp).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from shared.model.gguf_file import GgufFile

_CONTROL, _USER_DEFINED = 3, 4
_SPECIAL_KEYS = ("bos", "eos", "unknown", "padding")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` values whose merges were learned over a split other than GPT-2's.
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


@dataclass(frozen=True)
class GgufTokenizerInfo:
    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    add_bos: bool
    # the text of bos / eos, for chat templates ("" when the file names none)
    bos_token: str
    eos_token: str


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def build_gguf_tokenizer(gguf: GgufFile) -> GgufTokenizerInfo:
    kind = gguf.get("tokenizer.ggml.model")
    tokens: list[str] | None = gguf.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise gguf.error("has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    if kind == "gpt2":
        tok = _byte_level_bpe(gguf, tokens)
    elif kind == "llama":
        tok = _sentencepiece_bpe(gguf, tokens)
    else:
        raise gguf.error(f"unsupported tokenizer model {kind!r}; supported: ['gpt2', 'llama']")
    ids = {key: _token_id(gguf, key, len(tokens)) for key in _SPECIAL_KEYS}
    _add_special_tokens(gguf, tok, tokens, ids)
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False))
    tok.post_processor = _post_processor(tokens, ids["bos"], ids["eos"], add_bos, add_eos)
    return GgufTokenizerInfo(
        tokenizer=tok,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["padding"],
        add_bos=add_bos and ids["bos"] is not None,
        bos_token=tokens[ids["bos"]] if ids["bos"] is not None else "",
        eos_token=tokens[ids["eos"]] if ids["eos"] is not None else "",
    )


def _token_id(gguf: GgufFile, key: str, vocab: int) -> int | None:
    value = gguf.get(f"tokenizer.ggml.{key}_token_id")
    if value is None:
        return None
    if not 0 <= int(value) < vocab:
        raise gguf.error(
            f"tokenizer.ggml.{key}_token_id {value} outside the vocabulary [0, {vocab})"
        )
    return int(value)


def _merges(gguf: GgufFile, tokens: Sequence[str]) -> list[tuple[str, str]]:
    merges = gguf.get("tokenizer.ggml.merges")
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bad = next((m for m in pairs if len(m) != 2), None)
        if bad is not None:
            raise gguf.error(f"tokenizer.ggml.merges entry {' '.join(bad)!r} is not 'left right'")
        return pairs  # type: ignore[return-value]
    scores = gguf.get("tokenizer.ggml.scores")
    if scores is None:
        raise gguf.error("tokenizer has neither tokenizer.ggml.merges nor tokenizer.ggml.scores")
    return merges_from_scores(tokens, scores)


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The merges a sentencepiece vocabulary implies: every split of a piece into two pieces,
    best-scored result first (ties: shorter left, then shorter right, then vocabulary order)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked: list[tuple[str, str, float]] = []
    for piece, score in dict(zip(tokens, scores, strict=True)).items():
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        ranked.extend(local)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _byte_level_bpe(gguf: GgufFile, tokens: Sequence[str]) -> Tokenizer:
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    model = models.BPE(
        vocab=vocab,
        merges=_merges(gguf, tokens),
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    tok = Tokenizer(model)
    split = _PRE_SPLITS.get(str(gguf.get("tokenizer.ggml.pre", "")))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(gguf: GgufFile, tokens: Sequence[str]) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=_merges(gguf, tokens), fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(model)
    prefix_space = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _add_special_tokens(
    gguf: GgufFile, tok: Tokenizer, tokens: Sequence[str], ids: dict[str, int | None]
) -> None:
    types: Sequence[int] = gguf.get("tokenizer.ggml.token_type") or ()
    byte_level = gguf.get("tokenizer.ggml.model") == "gpt2"
    alphabet = set(byte_alphabet().values())
    # A CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel in byte-level
    # vocabularies; adding it would grow the vocabulary past the embedding, so it is skipped.
    special = [
        t
        for t, kind in zip(tokens, types, strict=False)
        if kind == _CONTROL and (not byte_level or set(t) <= alphabet)
    ]
    special += [tokens[i] for i in ids.values() if i is not None and tokens[i] not in special]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    vocab = tok.get_vocab(with_added_tokens=True)
    user = [
        t for t, kind in zip(tokens, types, strict=False) if kind == _USER_DEFINED and t in vocab
    ]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _post_processor(
    tokens: Sequence[str], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    add_bos = add_bos and bos is not None
    add_eos = add_eos and eos is not None
    head = f"{tokens[bos]}:0 " if add_bos and bos is not None else ""
    tail = f" {tokens[eos]}:0" if add_eos and eos is not None else ""
    single = f"{head}$A:0{tail}"
    pair = f"{single}{' ' + head.replace(':0', ':1').strip() if add_bos else ''} $B:1"
    pair += tail.replace(":0", ":1")
    specials = []
    if add_bos and bos is not None:
        specials.append((tokens[bos], bos))
    if add_eos and eos is not None and eos != bos:
        specials.append((tokens[eos], eos))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
