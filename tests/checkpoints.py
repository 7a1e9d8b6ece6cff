"""The tiny test checkpoints now live in `benchmarks/support/checkpoints.py` (shipped, so that
`pdserve bench engine` needs nothing from tests/). Import them from there; this module keeps
older imports working."""

from __future__ import annotations

from benchmarks.support.checkpoints import (
    BOS_TOKEN,
    EOS_TOKEN,
    EOT_TOKEN,
    build_checkpoint,
    build_tokenizer,
    cached_checkpoint,
    load_hf_model,
    special_ids,
)

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "EOT_TOKEN",
    "build_checkpoint",
    "build_tokenizer",
    "cached_checkpoint",
    "load_hf_model",
    "special_ids",
]
