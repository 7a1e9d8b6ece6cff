"""Tokenizers and the streaming detokenizer's UTF-8 safety."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.model.tokenizer import (
    REPLACEMENT_CHAR,
    ByteTokenizer,
    HfTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
)
from tests.support.checkpoints import (
    BOS_TOKEN,
    EOS_TOKEN,
    EOT_TOKEN,
    build_tokenizer,
    special_ids,
)

TEXTS = [
    "hello world",
    "héllo wörld",
    "日本語のテキスト",
    "emoji 😀👍🏽 mix",
    "the cat in the hat",
    "",
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_tokenizer().save(str(path))
    ids = special_ids()
    return HfTokenizer.from_file(
        path, bos_token_id=ids[BOS_TOKEN], eos_token_ids=[ids[EOS_TOKEN], ids[EOT_TOKEN]]
    )


def stream(tokenizer: Tokenizer, ids: Sequence[int], chunk: int = 1) -> list[str]:
    """Deltas from pushing `ids` `chunk` at a time, then the flush."""
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.flush()]


# ------------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 256
    assert ids[1:] == list(text.encode())
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_byte_tokenizer_specials() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == 259
    assert tok.eos_token_ids == frozenset({257})
    assert tok.decode([256, 104, 105, 257]) == "hi"
    assert tok.decode([256, 104, 257], skip_special_tokens=False) == "<|256|>h<|257|>"
    with pytest.raises(ValueError, match="256"):
        ByteTokenizer(vocab_size=100)


@pytest.mark.parametrize("text", TEXTS)
def test_hf_tokenizer_round_trip(hf_tokenizer: HfTokenizer, text: str) -> None:
    ids = hf_tokenizer.encode(text)
    assert ids[0] == hf_tokenizer.bos_token_id  # the tokenizer.json post-processor adds <s>
    assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.encode(text, add_special_tokens=False) == ids[1:]


def test_hf_tokenizer_merges_and_specials(hf_tokenizer: HfTokenizer) -> None:
    ids = hf_tokenizer.encode(" the", add_special_tokens=False)
    assert len(ids) == 1 and ids[0] >= 256  # " the" is a merged token, not four bytes
    assert hf_tokenizer.vocab_size == 256 + 6 + 3
    eos = min(hf_tokenizer.eos_token_ids)
    assert hf_tokenizer.decode([*ids, eos]) == " the"
    assert EOS_TOKEN in hf_tokenizer.decode([*ids, eos], skip_special_tokens=False)


def test_hf_tokenizer_matches_transformers(
    hf_tokenizer: HfTokenizer, checkpoint: Callable[..., Path]
) -> None:
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint("llama") / "tokenizer.json"))
    for text in TEXTS:
        assert hf_tokenizer.encode(text) == reference(text)["input_ids"]


def test_bad_tokenizer_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        HfTokenizer.from_file(path, bos_token_id=None, eos_token_ids=[])


# ---------------------------------------------------------------------------- detokenizer


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
@pytest.mark.parametrize("text", TEXTS)
def test_streaming_bytes_never_splits_characters(text: str, chunk: int) -> None:
    tok = ByteTokenizer()
    deltas = stream(tok, tok.encode(text), chunk)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_multibyte_char_is_held_until_complete() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    emoji = list("😀".encode())
    assert detok.push([ord("a")]) == "a"
    assert [detok.push([b]) for b in emoji] == ["", "", "", "😀"]
    cjk = list("世".encode())
    assert [detok.push([b]) for b in cjk] == ["", "", "世"]
    assert detok.flush() == ""


def test_invalid_bytes_become_one_replacement_once_known() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.push([0xE4, 0xB8]) == ""  # could still become a CJK character
    assert detok.push([ord("x")]) == REPLACEMENT_CHAR + "x"  # now it cannot
    assert detok.push([0xFF]) == ""  # never valid, but still at the end: held
    assert detok.push([ord("y")]) == REPLACEMENT_CHAR + "y"
    assert detok.push([0xF0, 0x9F]) == ""
    assert detok.flush() == REPLACEMENT_CHAR  # end of stream: it will never complete


def test_special_tokens_add_no_text() -> None:
    tok = ByteTokenizer()
    assert stream(tok, [256, *"hé".encode(), 257]) == ["", "h", "", "é", "", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_hf_byte_level_tokens(hf_tokenizer: HfTokenizer, text: str) -> None:
    ids = hf_tokenizer.encode(text)
    deltas = stream(hf_tokenizer, ids)
    assert "".join(deltas) == hf_tokenizer.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_prompt_context_keeps_leading_text(hf_tokenizer: HfTokenizer) -> None:
    prompt = hf_tokenizer.encode("the cat")
    completion = hf_tokenizer.encode(" in the hat", add_special_tokens=False)
    detok = IncrementalDetokenizer(hf_tokenizer, prompt_ids=prompt)
    text = "".join(detok.push([t]) for t in completion) + detok.flush()
    assert text == " in the hat"


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40), st.integers(min_value=1, max_value=5))
def test_streaming_bytes_equals_full_decode(text: str, chunk: int) -> None:
    tok = ByteTokenizer()
    deltas = stream(tok, tok.encode(text), chunk)
    assert "".join(deltas) == text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=258), max_size=30))
def test_streaming_arbitrary_ids_equals_full_decode(ids: list[int]) -> None:
    # Arbitrary bytes (often invalid UTF-8): the stream still adds up to the full decode.
    tok = ByteTokenizer()
    assert "".join(stream(tok, ids)) == tok.decode(ids)
