"""SmolLM2 as transformers reads the built-in GGUF: the reference the SmolLM2 tests compare
pdserve against. Dequantizing the GGUF takes transformers most of a minute, so the test process
loads it once, for every module that asks."""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from shared.model.gguf_builtin import smollm2_path


@cache
def hf_smollm2() -> Any:
    """transformers' model from the same GGUF file pdserve serves: fp32, eval mode, CPU."""
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()
