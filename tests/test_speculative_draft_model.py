"""Speculative decoding with a draft model (`{"method": "draft_model", "model": ...}`): a second
engine of a smaller model proposes the drafts, the target verifies them in one forward. Greedy
and seeded answers equal plain decoding's whatever the draft model (itself, a perturbed copy),
drafts are accepted, both engines give every block and seat back, P/D answers exactly, and a
draft model with another tokenizer is refused at start."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.export_hf import export_hf
from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.speculative.config import SpeculativeConfig
from shared.engine.speculative.draft_model import DraftModelProposer
from tests.sampling_reference import pd_generate
from tests.support.cluster import pd_cluster
from tests.test_speculative import PROMPTS, run, tokens


def spec(model: str, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=model, num_speculative_tokens=k)


def engine(model: str, speculative: SpeculativeConfig | None) -> EngineCore:
    config = EngineConfig(
        model=model, block_size=8, num_kv_blocks=96, max_batch_size=8, speculative=speculative
    )
    return EngineCore(config, role=DecodeSettings())


def draft_engine(core: EngineCore) -> EngineCore:
    assert core.drafter is not None
    proposer = core.drafter.proposer
    assert isinstance(proposer, DraftModelProposer)
    assert isinstance(proposer.engine, EngineCore)
    return proposer.engine


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The tiny model as a checkpoint directory, and a copy with every weight perturbed: the
    same tokenizer, other predictions."""
    root = tmp_path_factory.mktemp("draft")
    target, other = root / "target", root / "perturbed"
    export_hf("tiny", target)
    other.mkdir()
    for path in target.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    weights = load_file(str(other / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    noisy = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    save_file(noisy, str(other / "model.safetensors"), metadata={"format": "pt"})
    return str(target), str(other)


@pytest.mark.parametrize("which", ["itself", "perturbed"])
def test_greedy_and_seeded_answers_equal_plain_decoding(
    checkpoints: tuple[str, str], which: str
) -> None:
    target, perturbed = checkpoints
    draft = target if which == "itself" else perturbed
    work = [
        (PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True)),
        (PROMPTS[1], SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(max_tokens=17, logprobs=2, ignore_eos=True)),
    ]
    want = run(engine(target, None), work)
    core = engine(target, spec(draft))
    got = run(core, work)
    assert tokens(got) == tokens(want)
    assert [d[-1][1] for d in got.values()] == [d[-1][1] for d in want.values()]
    drafter = core.drafter
    assert drafter is not None and drafter.proposed > 0
    if which == "itself":  # the model's own greedy continuation: (nearly) every draft holds
        greedy = engine(target, spec(draft))
        out = run(greedy, [(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS])
        assert greedy.drafter is not None and greedy.drafter.proposed > 0
        assert greedy.drafter.accepted >= 0.9 * greedy.drafter.proposed
        assert any(len(ids) > 1 for deltas in out.values() for ids, _ in deltas)
    draft_engine(core).check_conservation()
    assert not draft_engine(core).has_work


def test_a_draft_model_with_another_tokenizer_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="does not share the tokenizer"):
        engine("tiny", spec("smollm2"))


def test_across_the_split_the_decode_node_drafts_with_its_draft_model(
    checkpoints: tuple[str, str],
) -> None:
    target, _ = checkpoints
    params = SamplingParams(max_tokens=20, ignore_eos=True)

    async def answer(speculative: SpeculativeConfig | None) -> list[int]:
        decode = EngineConfig(model=target, num_kv_blocks=256, speculative=speculative)
        prefill = EngineConfig(model=target, num_kv_blocks=256)
        async with pd_cluster(target, prefill_engine=prefill, decode_engine=decode) as c:
            got = await pd_generate(c.targets[0], PROMPTS[0], params)
            await c.assert_idle_and_conserved()
            accepted = (await asyncio.to_thread(c.metrics))[-1].get(
                "pdserve_spec_drafts_accepted_total", 0.0
            )
            assert (accepted > 0) == (speculative is not None)
        return got

    assert asyncio.run(answer(spec(target))) == asyncio.run(answer(None))


def test_the_config_names_the_draft_model() -> None:
    text = '{"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}'
    assert SpeculativeConfig.from_json(text) == spec("tiny", 2)
