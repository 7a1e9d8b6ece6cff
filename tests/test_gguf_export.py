"""`pdserve export-hf`: transformers loads the exported directory and produces pdserve's greedy
tokens, tokenization and chat prompt; pdserve loads it back to the same weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pdserve.cli.main import main
from pdserve.export_hf import FILES, export_hf
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.engine_helpers import random_prompts
from tests.gguf_writer import gpt2_vocab_size, write_gguf

TEXTS = ["Hello world", "café 日本 😀", "  two  spaces\n\nand lines", "<s>x</s>"]
MESSAGES = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]


def hf_greedy(out_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=0,
            )
        results.append(gen[0, len(prompt) :].tolist())
    return results


def pdserve_greedy(spec: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    loaded = load_model(spec, dtype=torch.float32)
    llm = LLM(EngineConfig(model=spec, num_kv_blocks=256, device="cpu"), loaded)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    llm.check_conservation()
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_exported_gguf_runs_in_transformers(
    checkpoint: Callable[..., Path], tmp_path: Path, arch: str
) -> None:
    from transformers import AutoTokenizer

    source = write_gguf(checkpoint(arch, vocab_size=gpt2_vocab_size()), tmp_path / "m.gguf", Q.Q8_0)
    out = tmp_path / "hf"
    assert main(["export-hf", "--model", str(source), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)

    prompts = random_prompts(3, gpt2_vocab_size() - 3, min_len=2, max_len=30, seed=5)
    assert hf_greedy(out, prompts, 6) == pdserve_greedy(str(source), prompts, 6)

    ours = load_model(str(source)).tokenizer
    theirs = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert theirs(text).input_ids == ours.encode(text)
    template = load_model(str(out)).chat_template
    assert template is not None
    assert template.render(MESSAGES) == theirs.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    generation = json.loads((out / "generation_config.json").read_text())
    assert sorted(generation["eos_token_id"]) == sorted(load_model(str(source)).eos_token_ids)


def test_exported_directory_loads_back_identically(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    source = write_gguf(
        checkpoint("llama", vocab_size=gpt2_vocab_size()), tmp_path / "m.gguf", Q.Q4_0
    )
    export_hf(str(source), tmp_path / "hf")
    a = load_model(str(source)).model.state_dict()
    b = load_model(str(tmp_path / "hf")).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tiny_exports_with_a_byte_level_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    out = tmp_path / "tiny"
    export_hf("tiny", out)
    ours = load_model("tiny").tokenizer
    theirs = AutoTokenizer.from_pretrained(out)
    # ByteTokenizer never reads special-token text in a prompt; a tokenizer.json always does
    for text in TEXTS[:-1]:
        assert theirs(text).input_ids == ours.encode(text)
    prompts = [ours.encode(t) for t in TEXTS]
    assert hf_greedy(out, prompts, 5) == pdserve_greedy("tiny", prompts, 5)
    assert not (out / "chat_template.jinja").exists()


def test_export_error_names_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"nope")
    assert main(["export-hf", "--model", str(bogus), str(tmp_path / "out")]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err
