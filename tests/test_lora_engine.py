"""LoRA adapters through the colocated engine: greedy tokens equal transformers with peft's
LoRA forward for each adapter alone and for the base and every adapter mixed in one continuous
batch (chunked prefill included), the prefix cache never shares blocks across adapters, an
unknown adapter is refused naming it, and every block and seat comes back after each scenario."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.errors import RequestRejected
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.engine_helpers import hf_greedy_with, random_prompts, single_torch_thread
from tests.support.checkpoints import cached_checkpoint, load_hf_model
from tests.support.lora_files import AdapterSpec, peft_hooks, write_adapter

VOCAB = 512
CHUNK = 32
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECS = {
    "all-r4": AdapterSpec(rank=4, alpha=8.0, targets=ALL, seed=11),
    "qv-r8": AdapterSpec(8, 16.0, ("q_proj", "v_proj"), seed=12, rslora=True),
    "mlp-r2": AdapterSpec(2, 4.0, ("gate_proj", "up_proj", "down_proj"), seed=13),
}
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora-engine")
    base = cached_checkpoint(root, "llama", num_hidden_layers=2, num_key_value_heads=2)
    hf = load_hf_model(base)
    tensors = {n: write_adapter(hf, root / n, spec) for n, spec in SPECS.items()}
    prompts = random_prompts(4, VOCAB, min_len=6, max_len=70, seed=21)
    with single_torch_thread():
        want: dict[str | None, list[list[int]]] = {
            None: [hf_greedy_with(hf, p, MAX_TOKENS) for p in prompts]
        }
        for name, spec in SPECS.items():
            with peft_hooks(hf, tensors[name], spec):
                want[name] = [hf_greedy_with(hf, p, MAX_TOKENS) for p in prompts]
    assert all(want[n] != want[None] for n in SPECS), "an adapter does not change greedy output"
    return base, {n: str(root / n) for n in SPECS}, prompts, want


def _engine(base: Path, paths: dict[str, str]) -> LLM:
    config = EngineConfig(
        model=str(base),
        num_kv_blocks=256,
        max_batch_size=8,
        max_num_tokens=CHUNK,
        block_size=8,
        lora_modules=tuple(paths.items()),
        max_lora_rank=8,
    )
    return LLM(config, load_model(str(base), dtype=torch.float32))


def test_each_adapter_alone_and_all_mixed_match_peft(setup) -> None:
    base, paths, prompts, want = setup
    engine = _engine(base, paths)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with single_torch_thread():
        for name in SPECS:
            outs = engine.generate(prompts, replace(greedy, lora_adapter=name))
            assert [o.token_ids for o in outs] == want[name], name
            engine.check_conservation()
        # every prompt under the base and each adapter, all in one continuous batch
        names: list[str | None] = [None, *SPECS]
        mixed = [(p, n) for p in prompts for n in names]
        params = [replace(greedy, lora_adapter=n) for _, n in mixed]
        outs = engine.generate([p for p, _ in mixed], params)
    for (p, n), out in zip(mixed, outs, strict=True):
        assert out.token_ids == want[n][prompts.index(p)], (n, len(p))
    engine.check_conservation()


def test_prefix_cache_is_keyed_by_adapter(setup) -> None:
    base, paths, prompts, want = setup
    engine = _engine(base, paths)
    prompt = prompts[0] if len(prompts[0]) >= 24 else max(prompts, key=len)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with single_torch_thread():
        [first] = engine.generate([prompt], replace(greedy, lora_adapter="all-r4"))
        [other] = engine.generate([prompt], replace(greedy, lora_adapter="qv-r8"))
        [plain] = engine.generate([prompt], greedy)
        [again] = engine.generate([prompt], replace(greedy, lora_adapter="all-r4"))
    assert first.cached_tokens == other.cached_tokens == plain.cached_tokens == 0
    assert again.cached_tokens >= 8  # the same adapter reuses its own blocks
    i = prompts.index(prompt)
    assert (first.token_ids, other.token_ids, plain.token_ids, again.token_ids) == (
        want["all-r4"][i],
        want["qv-r8"][i],
        want[None][i],
        want["all-r4"][i],
    )
    engine.check_conservation()


def test_unknown_adapter_is_refused_naming_it(setup) -> None:
    base, paths, prompts, _ = setup
    engine = _engine(base, paths)
    with pytest.raises(RequestRejected, match="'nope' is not loaded on this node"):
        engine.add_request(prompts[0], SamplingParams(max_tokens=2, lora_adapter="nope"))
    engine.check_conservation()
