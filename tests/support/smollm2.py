"""SmolLM2 as transformers reads the built-in GGUF: the reference the SmolLM2 tests compare
pdserve against. The test process loads it once, for every module that asks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import cache
from typing import Any
from unittest import mock

import torch

from shared.model.gguf_builtin import smollm2_path


@cache
def hf_smollm2() -> Any:
    """transformers' model from the same GGUF file pdserve serves: fp32, eval mode, CPU."""
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    with _gguf_lookups_memoised():
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


@contextlib.contextmanager
def _gguf_lookups_memoised() -> Iterator[None]:
    """transformers parses the file twice (config, then weights: ~4 s each, most of it the
    tokenizer's 49k-entry fields) and rebuilds gguf's tensor-name table once per module (~400
    times, 14 ms each). Both are pure lookups on the same inputs: memoised for the one load, the
    reference's numbers are transformers' own (its dequantization and its model code)."""
    import gguf

    readers: dict[str, Any] = {}
    real_reader = gguf.GGUFReader

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = repr((str(path), args, sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    names = cache(gguf.get_tensor_name_map)
    with (
        mock.patch.object(gguf, "GGUFReader", reader),
        mock.patch.object(gguf, "get_tensor_name_map", names),
    ):
        yield
