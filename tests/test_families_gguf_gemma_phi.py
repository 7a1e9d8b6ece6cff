"""GGUF `gemma2`, `gemma3` and `phi3`, written the way llama.cpp converts (tests/
gguf_family_writer.py): greedy tokens equal transformers' run of the source checkpoint (F32,
features llama.cpp's metadata carries: soft-caps, windows shorter than the prompts, a
non-default layer pattern, scaled global rope beside a local base, partial rotary), and
transformers' own reading of the same file (Q8_0, models inside what transformers' GGUF reader
maps). `export-hf` writes each back as a directory transformers and pdserve load to the same
weights; the SentencePiece vocabulary and chat template come from the file; the attention scale
llama.cpp derives for Gemma 2 is derived alike; longrope and yarn files fail at load."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pdserve.export_hf import export_hf
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.gguf_file import GgufError, open_gguf
from shared.model.gguf_loader import gguf_model_config
from shared.model.loader import load_model
from tests.engine_helpers import hf_greedy, hf_greedy_with, single_torch_thread
from tests.gguf_family_writer import write_family_gguf
from tests.support.checkpoints import load_hf_model
from tests.test_families_parity import FULL, SLIDING, WINDOW, engine_config, family_prompts

MAX_TOKENS = 8
# features llama.cpp's metadata carries; checked against the source checkpoint
FROM_SOURCE: dict[str, tuple[str, dict[str, object]]] = {
    "gemma2-softcap": (
        "gemma2",
        {
            "num_hidden_layers": 3,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 8.0,
            "final_logit_softcapping": 12.0,
        },
    ),
    "gemma3-scaled-untied": (
        "gemma3",
        {
            "num_hidden_layers": 4,
            "layer_types": [SLIDING, FULL, SLIDING, SLIDING],
            "num_key_value_heads": 1,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": WINDOW,
            "tie_word_embeddings": False,
            "final_logit_softcapping": 15.0,
            "rope_parameters": {
                FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                SLIDING: {"rope_type": "default", "rope_theta": 20_000.0},
            },
        },
    ),
    "phi3-partial-rotary-window": (
        "phi3",
        {"partial_rotary_factor": 0.5, "sliding_window": WINDOW, "num_hidden_layers": 3},
    ),
}
# inside what transformers' GGUF reader maps (it takes transformers' defaults for the rest:
# attention scale 256, Gemma's soft-caps and layer patterns, Phi-3's full rotary)
TRANSFORMERS_READABLE: dict[str, tuple[str, dict[str, object]]] = {
    "gemma2-defaults": ("gemma2", {"num_hidden_layers": 3, "head_dim": 256, "sliding_window": 24}),
    "gemma3-five-local-one-global": (
        "gemma3",
        {"num_hidden_layers": 6, "head_dim": 256, "sliding_window": WINDOW},
    ),
    "phi3-full-rotary": ("phi3", {"num_hidden_layers": 2}),
}


def _pdserve_tokens(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    loaded = load_model(str(path), dtype=torch.float32)
    llm = LLM(engine_config(path), loaded)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    llm.check_conservation()
    return [out.token_ids for out in outputs]


@pytest.mark.parametrize("name", list(FROM_SOURCE))
def test_gguf_serves_the_source_checkpoints_tokens_and_exports(
    name: str, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    arch, kwargs = FROM_SOURCE[name]
    source = checkpoint(arch, **kwargs)
    path = write_family_gguf(source, tmp_path / f"{name}.gguf", Q.F32)
    # the same config but for the special ids (another vocabulary) and eps rounded to float32
    got_config, source_config = load_model(str(path)).config, load_model(str(source)).config
    ids = ("bos_token_id", "eos_token_ids", "pad_token_id")
    eps = float(np.float32(source_config.rms_norm_eps))
    assert got_config == replace(
        source_config, **{k: getattr(got_config, k) for k in ids}, rms_norm_eps=eps
    )
    prompts = family_prompts(seed=11)
    with single_torch_thread():
        got = _pdserve_tokens(path, prompts)
        want = [hf_greedy(source, p, MAX_TOKENS, eos_token_id=None) for p in prompts]
    assert got == want
    export_hf(str(path), tmp_path / "hf")
    a = load_model(str(path), dtype=torch.float32)
    b = load_model(str(tmp_path / "hf"), dtype=torch.float32)
    assert a.config == b.config
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        exported = load_hf_model(tmp_path / "hf")(ids).logits
        original = load_hf_model(source)(ids).logits
    torch.testing.assert_close(exported, original, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(TRANSFORMERS_READABLE))
def test_quantized_gguf_matches_transformers_reading_the_file(
    name: str, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    arch, kwargs = TRANSFORMERS_READABLE[name]
    path = write_family_gguf(checkpoint(arch, **kwargs), tmp_path / f"{name}.gguf", Q.Q8_0)
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompts = family_prompts(seed=12)
    with single_torch_thread():
        got = _pdserve_tokens(path, prompts)
        want = [hf_greedy_with(reference, p, MAX_TOKENS, eos_token_id=None) for p in prompts]
    assert got == want


def test_gemma_gguf_tokenizer_and_chat_template(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    arch, kwargs = FROM_SOURCE["gemma2-softcap"]
    path = write_family_gguf(checkpoint(arch, **kwargs), tmp_path / "gemma.gguf")
    loaded = load_model(str(path))
    tok = loaded.tokenizer
    ids = tok.encode("Hello world")
    assert ids[0] == 1 and tok.decode(ids[1:]) == "Hello world"  # bos, no space prefix
    assert loaded.chat_template is not None
    text = loaded.chat_template.render([{"role": "user", "content": "hi"}])
    assert text == "<s><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


def _longrope(w: gguf.GGUFWriter) -> None:
    w.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))


def _yarn(w: gguf.GGUFWriter) -> None:
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)


@pytest.mark.parametrize(
    ("name", "extra", "problem"),
    [
        ("phi3-full-rotary", _longrope, "Phi-3 longrope (the 128k-context variants)"),
        ("gemma3-five-local-one-global", _yarn, "unsupported rope scaling 'yarn' (factor 4.0)"),
    ],
)
def test_unsupported_variants_fail_at_load_naming_the_problem(
    name: str,
    extra: Callable[[gguf.GGUFWriter], None],
    problem: str,
    checkpoint: Callable[..., Path],
    tmp_path: Path,
) -> None:
    arch, kwargs = TRANSFORMERS_READABLE[name]
    path = write_family_gguf(checkpoint(arch, **kwargs), tmp_path / "bad.gguf", extra=extra)
    with pytest.raises(GgufError, match=re.escape(problem)):
        load_model(str(path))


@pytest.mark.parametrize(
    ("layers", "scale", "want"),
    [
        (46, None, 4608 / 32),  # llama.cpp's Gemma 2 27B: 1/sqrt(hidden / heads)
        (42, None, 128.0),  # every other size: 1/sqrt(head_dim)
        (42, 0.125, 64.0),  # an explicit attention.scale wins
    ],
)
def test_gemma2_attention_scale_as_llama_cpp_derives_it(
    layers: int, scale: float | None, want: float, tmp_path: Path
) -> None:
    path = tmp_path / "scale.gguf"
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_context_length(64)
    w.add_embedding_length(4608)
    w.add_block_count(layers)
    w.add_feed_forward_length(8)
    w.add_head_count(32)
    w.add_head_count_kv(16)
    w.add_key_length(128)
    w.add_sliding_window(16)
    if scale is not None:
        w.add_attention_scale(scale)
    w.add_tensor("token_embd.weight", np.zeros((4, 4608), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = gguf_model_config(open_gguf(path))
    assert config.query_pre_attn_scalar == want
    assert config.sliding_window_layers == tuple(range(0, layers, 2))
