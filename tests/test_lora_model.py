"""LoRA adapters on the model: PEFT files read and checked against the base model, and the
batched delta against transformers with peft's LoRA forward (tests/support/lora_files.py), for
adapters of different ranks, scalings and target modules, alone and mixed in one batch with the
base model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shared.kv.pool import allocate_kv_pool
from shared.model.forward_batch import ForwardBatch, SeqEntry
from shared.model.loader import LoadedModel, load_model
from shared.model.lora_adapter import AdapterError
from shared.model.lora_batch import lora_batch
from shared.model.lora_install import install_lora
from tests.engine_helpers import random_prompts, single_torch_thread
from tests.support.checkpoints import cached_checkpoint, load_hf_model
from tests.support.lora_files import AdapterSpec, peft_hooks, write_adapter

VOCAB = 512
BLOCK = 4
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECS = {
    "all-r4": AdapterSpec(rank=4, alpha=8.0, targets=ALL, seed=1),
    "qv-r8-rslora": AdapterSpec(
        rank=8, alpha=16.0, targets=("q_proj", "v_proj"), seed=2, rslora=True
    ),
    "o-down-r2": AdapterSpec(rank=2, alpha=4.0, targets=("o_proj", "down_proj"), seed=3),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path], dict]:
    root = tmp_path_factory.mktemp("lora")
    base = cached_checkpoint(root, "llama", num_hidden_layers=2, num_key_value_heads=2)
    hf = load_hf_model(base)
    tensors = {n: write_adapter(hf, root / n, spec) for n, spec in SPECS.items()}
    return base, {n: root / n for n in SPECS}, tensors


def _loaded(base: Path, paths: dict[str, Path]) -> LoadedModel:
    loaded = load_model(str(base), dtype=torch.float32)
    install_lora(loaded.model, {n: str(p) for n, p in paths.items()}, max_loras=4, max_rank=8)
    return loaded


def _logits(loaded: LoadedModel, prompts: list[list[int]], names: list[str | None]) -> torch.Tensor:
    bank = loaded.model.lora
    assert bank is not None
    pool = allocate_kv_pool(loaded.config.kv_layout(BLOCK, torch.float32), 256, "cpu")
    entries = [SeqEntry(p, 0, list(range(i * 32, i * 32 + 32))) for i, p in enumerate(prompts)]
    batch = ForwardBatch.build(entries, BLOCK, "cpu")
    slots = [-1 if n is None else bank.slots[n] for n in names]
    batch = replace(batch, lora=lora_batch(slots, batch.query_lens, torch.device("cpu")))
    return loaded.model(batch, pool, all_logits=True)


def test_each_adapter_matches_peft_reference(setup) -> None:
    base, paths, tensors = setup
    loaded, hf = _loaded(base, paths), load_hf_model(base)
    prompts = random_prompts(2, VOCAB, min_len=5, max_len=40, seed=7)
    with single_torch_thread(), torch.inference_mode():
        for name, spec in SPECS.items():
            got = _logits(loaded, prompts, [name, name])
            with peft_hooks(hf, tensors[name], spec):
                want = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
            base_logits = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
            assert (want - base_logits).abs().max() > 1e-2, f"{name} does not change the output"
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=name)


def test_mixed_batch_gives_each_request_its_own_output(setup) -> None:
    base, paths, _ = setup
    loaded = _loaded(base, paths)
    prompts = random_prompts(4, VOCAB, min_len=5, max_len=30, seed=9)
    names: list[str | None] = [None, "all-r4", "qv-r8-rslora", "o-down-r2"]
    with single_torch_thread():
        mixed = _logits(loaded, prompts, names)
        alone = torch.cat([_logits(loaded, [p], [n]) for p, n in zip(prompts, names, strict=True)])
        plain = loaded.model(
            ForwardBatch.build([SeqEntry(prompts[0], 0, list(range(32)))], BLOCK, "cpu"),
            allocate_kv_pool(loaded.config.kv_layout(BLOCK, torch.float32), 64, "cpu"),
            all_logits=True,
        )
    torch.testing.assert_close(mixed, alone, atol=1e-5, rtol=0)
    # a base request in a mixed batch computes what the model without adapters computes
    torch.testing.assert_close(mixed[: len(prompts[0])], plain, atol=1e-5, rtol=0)


def test_bad_adapters_are_refused_naming_file_and_field(setup, tmp_path: Path) -> None:
    base, paths, _ = setup
    loaded = load_model(str(base), dtype=torch.float32)
    hf_other = load_hf_model(
        cached_checkpoint(tmp_path, "llama", num_hidden_layers=2, hidden_size=48)
    )
    write_adapter(hf_other, tmp_path / "other", SPECS["all-r4"])
    shape_error = r"adapter_model\.safetensors: layer \d+ \w+: lora_[AB] shape"
    with pytest.raises(AdapterError, match=shape_error):
        install_lora(loaded.model, {"other": str(tmp_path / "other")}, 2, 8)
    with pytest.raises(AdapterError, match="exceeds --max-lora-rank 4"):
        install_lora(loaded.model, {"big": str(paths["qv-r8-rslora"])}, 2, 4)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_model.safetensors").write_bytes(
        (paths["all-r4"] / "adapter_model.safetensors").read_bytes()
    )
    config = json.loads((paths["all-r4"] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(config | {"target_modules": ["lm_head"]}))
    with pytest.raises(AdapterError, match=r"adapter_config\.json: field 'target_modules'"):
        install_lora(loaded.model, {"bad": str(bad)}, 2, 8)
    (bad / "adapter_config.json").write_text(json.dumps(config | {"r": 5}))
    with pytest.raises(AdapterError, match="rank 4, field 'r' / 'rank_pattern' says 5"):
        install_lora(loaded.model, {"bad": str(bad)}, 2, 8)
