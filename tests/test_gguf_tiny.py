"""Small GGUF files written here from random-weight transformers checkpoints: pdserve reading a
file computes what transformers reading the same file computes (gguf_file=...)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.kv.pool import allocate_kv_pool
from shared.model.forward_batch import ForwardBatch, SeqEntry
from shared.model.gguf_loader import unpermute_rope_rows
from shared.model.loader import load_model
from tests.engine_helpers import random_prompts
from tests.gguf_writer import gpt2_vocab_size, rope_permute, write_gguf

QTYPES = (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def gguf_file(
    checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, Q], Path]:
    root = tmp_path_factory.mktemp("gguf")

    @cache
    def write(arch: str, qtype: Q) -> Path:
        # llama: GQA (4 heads over 2 KV heads), untied head; qwen2: q/k/v biases, tied head
        source = checkpoint(arch, vocab_size=gpt2_vocab_size())
        out = root / f"{arch}-{qtype.name}"
        out.mkdir()
        return write_gguf(source, out / "model.gguf", qtype)

    return write


@cache
def _hf_gguf_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    file = Path(path)
    model = AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32
    )
    return model.eval()


def hf_gguf_greedy(file: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = _hf_gguf_model(str(file)).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
        )
    return out[0, len(prompt) :].tolist()


def test_rope_unpermute_inverts_llama_cpp_permute() -> None:
    w = torch.randn(4 * 2 * 8, 5).numpy()
    assert (unpermute_rope_rows(rope_permute(w, 4), 4) == w).all()
    assert not (rope_permute(w, 4) == w).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_greedy_matches_transformers_on_same_file(
    gguf_file: Callable[[str, Q], Path], arch: str, qtype: Q
) -> None:
    file = gguf_file(arch, qtype)
    loaded = load_model(str(file), dtype=torch.float32)
    assert loaded.config.tie_word_embeddings == (arch == "qwen2")
    assert loaded.config.attention_bias == (arch == "qwen2")
    assert loaded.config.num_kv_heads == 2 and loaded.config.num_heads == 4
    llm = LLM(EngineConfig(model=str(file), max_num_tokens=32, device="cpu"), loaded)
    prompts = random_prompts(4, loaded.config.vocab_size, min_len=3, max_len=50, seed=7)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_gguf_greedy(file, prompt, MAX_TOKENS)
    llm.check_conservation()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_logits_match_transformers(gguf_file: Callable[[str, Q], Path], arch: str) -> None:
    file = gguf_file(arch, Q.Q8_0)
    loaded = load_model(str(file), dtype=torch.float32)
    prompt = random_prompts(1, loaded.config.vocab_size, min_len=40, max_len=40, seed=3)[0]
    pool = allocate_kv_pool(loaded.config.kv_layout(16, torch.float32), 8, "cpu")
    batch = ForwardBatch.build([SeqEntry(prompt, 0, [0, 1, 2])], 16, "cpu")
    ours = loaded.model(batch, pool, all_logits=True)
    with torch.inference_mode():
        theirs = _hf_gguf_model(str(file))(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_directory_with_one_gguf_loads(gguf_file: Callable[[str, Q], Path]) -> None:
    file = gguf_file("llama", Q.F16)
    loaded = load_model(str(file.parent), dtype=torch.float32)
    assert loaded.name == "model"
    assert loaded.chat_template is not None
    assert loaded.generation_defaults == {}


def test_every_declared_eos_stops(gguf_file: Callable[[str, Q], Path]) -> None:
    from tests.support.checkpoints import EOS_TOKEN, EOT_TOKEN, special_ids

    loaded = load_model(str(gguf_file("qwen2", Q.F32)), dtype=torch.float32)
    ids = special_ids()
    assert loaded.eos_token_ids == {ids[EOS_TOKEN], ids[EOT_TOKEN]}
    assert loaded.tokenizer.eos_token_ids == loaded.eos_token_ids


def test_bfloat16_node_dtype(gguf_file: Callable[[str, Q], Path]) -> None:
    loaded = load_model(str(gguf_file("llama", Q.Q4_0)), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())


def test_sampling_defaults_from_metadata(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    source = checkpoint("llama", vocab_size=gpt2_vocab_size())
    file = write_gguf(source, tmp_path / "m.gguf", sampling={"temp": 0.5, "top_k": 20})
    assert load_model(str(file)).generation_defaults == {"temperature": 0.5, "top_k": 20}


def test_run_prompt_applies_the_chat_template_with_one_bos(
    gguf_file: Callable[[str, Q], Path],
) -> None:
    from pdserve.cli.up_command import run_prompt
    from tests.support.checkpoints import BOS_TOKEN, special_ids

    # the file adds BOS when encoding, and its template writes bos_token itself
    file = gguf_file("llama", Q.F32)
    ids = run_prompt(str(file), "Hi")
    loaded = load_model(str(file))
    assert loaded.tokenizer.encode("x")[0] == special_ids()[BOS_TOKEN]
    assert isinstance(ids, list) and ids.count(special_ids()[BOS_TOKEN]) == 1
    assert (
        loaded.tokenizer.decode(ids, skip_special_tokens=False) == "<s><|user|>Hi</s><|assistant|>"
    )
    assert run_prompt("tiny", "Hi") == "Hi"  # no template: the raw text
