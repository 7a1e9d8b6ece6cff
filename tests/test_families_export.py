"""`pdserve export-hf` on Qwen3, Gemma 2, Gemma 3 and Phi-3: transformers loads the exported
directory and computes the source checkpoint's logits (config mapping written back: windows,
layer patterns, rope bases and scaling, soft-caps, partial rotary; Phi-3's q/k/v and gate/up
stacked again), and pdserve loads it back to the same weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.export_hf import export_hf
from shared.model.loader import load_model
from tests.engine_helpers import random_prompts
from tests.support.checkpoints import load_hf_model
from tests.test_families_parity import VARIANTS


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_round_trips_through_transformers(
    name: str, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    arch, kwargs = VARIANTS[name]
    source = checkpoint(arch, **kwargs)
    out = tmp_path / "hf"
    export_hf(str(source), out)
    original, exported = load_hf_model(source), load_hf_model(out)
    assert type(exported) is type(original)
    ids = torch.tensor([random_prompts(1, 512, min_len=60, max_len=60, seed=4)[0]])
    with torch.inference_mode():
        want, got = original(ids).logits, exported(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    a = load_model(str(source), dtype=torch.float32)
    b = load_model(str(out), dtype=torch.float32)
    assert a.config == b.config
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
