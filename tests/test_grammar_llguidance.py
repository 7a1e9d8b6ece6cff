"""llguidance's pieces on their own: its regexes read \\d \\w \\s as ASCII (as xgrammar's and
JSON Schema's do), and the two ways of applying a token bitmask (numpy on CPU, torch ops on an
accelerator) forbid exactly the tokens whose bit is 0, in the layout both libraries fill."""

from __future__ import annotations

import re

import pytest
import torch

from shared.engine.sampling.grammar_kinds import GrammarError
from shared.engine.sampling.grammar_llguidance import (
    allows,
    apply_bitmask,
    ascii_classes,
    closed,
    compile_llg,
    forbidden_on_device,
    llg_tokenizer,
)
from shared.engine.sampling.structured_output import StructuredOutput
from shared.model.tokenizer import ByteTokenizer


@pytest.mark.parametrize(
    ("regex", "ascii"),
    [
        (r"\d{1,3}", "[0-9]{1,3}"),
        (r"[\da-f]+\.\w", r"[0-9a-f]+\.[a-zA-Z0-9_]"),
        (r"\\d[\]\d]", r"\\d[\]0-9]"),  # an escaped backslash, an escaped bracket
        (r"[]\d]\D", r"[]0-9][^0-9]"),  # a leading ] is literal
        (r"[^]\s]x", r"[^] \t\n\r\f\v]x"),
    ],
)
def test_ascii_classes(regex: str, ascii: str) -> None:
    assert ascii_classes(regex) == ascii
    for text in ("7", "a", "]", "߁", " ", "\\d"):  # N'Ko digit one: \d in Rust, not in ASCII
        assert bool(re.fullmatch(ascii, text)) == bool(re.fullmatch(regex, text, re.ASCII))


def test_regex_digits_are_ascii_and_bad_specs_name_the_problem() -> None:
    tok = llg_tokenizer(ByteTokenizer(), 259)
    digits = compile_llg(tok, StructuredOutput("regex", r"\d{1,3}"))
    assert allows(digits, list(b"123")) and not allows(digits, list("߁".encode()))
    with pytest.raises(GrammarError, match=r"invalid regex: .*unclosed"):
        compile_llg(tok, StructuredOutput("regex", "[a-"))
    unique = '{"type": "array", "uniqueItems": true}'
    with pytest.raises(GrammarError, match="uniqueItems"):
        compile_llg(tok, StructuredOutput("json_schema", unique))


def test_bitmask_paths_agree() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 49_152 + 7  # a partial last word
    words = torch.randint(-(2**31), 2**31 - 1, (4, (vocab + 31) // 32), generator=gen)
    words = words.to(torch.int32)
    logits = torch.randn(4, vocab, generator=gen)
    expected = torch.tensor(
        [[(int(words[r, t // 32]) >> (t % 32)) & 1 == 0 for t in range(vocab)] for r in range(4)]
    )
    assert torch.equal(forbidden_on_device(words, vocab), expected)
    for dtype in (torch.float32, torch.bfloat16):
        out = logits.to(dtype)
        apply_bitmask(out, words)
        assert torch.equal(torch.isneginf(out), expected)
        assert torch.equal(out[~expected], logits.to(dtype)[~expected])


def test_objects_with_properties_are_closed_as_xgrammar_strict_mode_reads_them() -> None:
    item = {"type": "object", "properties": {"properties": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": item}},
        "$defs": {"open": {"properties": {}, "additionalProperties": True}},
        "anyOf": [{"properties": {"b": {}}}, {"type": "object"}],
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    inner = out["properties"]["a"]["items"]
    assert inner["additionalProperties"] is False
    assert inner["properties"] == {"properties": {"type": "string"}}  # a property's name only
    assert out["$defs"]["open"]["additionalProperties"] is True  # said: kept
    assert out["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in out["anyOf"][1]  # no properties listed: any object
    tok = llg_tokenizer(ByteTokenizer(), 259)
    pet = '{"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"]}'
    grammar = compile_llg(tok, StructuredOutput("json_schema", pet))
    assert allows(grammar, list(b'{"kind": "cat"}'))
    assert not allows(grammar, list(b'{"kind": "cat", "x'))
