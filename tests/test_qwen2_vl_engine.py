"""Qwen2-VL and Qwen2.5-VL through the engine against transformers, token for token (fp32):
prompts with 0, 1 and 2 images of different sizes, prefill chunks that split an image, a
repeated image served from the prefix cache, another image of the same size that must not be,
and a seat reused by a text request after an image request (it must not read the old delta).
Every scenario ends with every seat, block and mRoPE delta row back in its pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.errors import RequestRejected
from shared.engine.llm import LLM
from shared.engine.requests.multimodal import PromptImage
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.engine_helpers import pad_decode_steps, single_torch_thread
from tests.support.vision_checkpoints import (
    IMAGE_TOKEN,
    QWEN2_5_VL,
    QWEN2_VL,
    build_vl_checkpoint,
    hf_vl_greedy,
    image_prompt,
    random_image,
)

NEW_TOKENS = 6
CHUNK = 24  # smaller than the image prompts: chunks start and end inside images


@pytest.fixture(scope="module", params=[QWEN2_VL, QWEN2_5_VL])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vl_checkpoint(tmp_path_factory.mktemp("vl"), request.param)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> torch.nn.Module:
    import transformers

    arch = checkpoint.name
    return getattr(transformers, arch).from_pretrained(checkpoint, dtype=torch.float32).eval()


def _llm(checkpoint: Path, **overrides: object) -> LLM:
    settings: dict[str, object] = {
        "model": str(checkpoint),
        "dtype": "float32",
        "num_kv_blocks": 64,
        "block_size": 8,
        "max_num_tokens": CHUNK,
        "max_batch_size": 4,
    }
    config = EngineConfig(**(settings | overrides))  # type: ignore[arg-type]
    return LLM(config, load_model(str(checkpoint), dtype=torch.float32))


def _run(llm: LLM, prompt: list[int], images: list[PromptImage]) -> tuple[list[int], int]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    request = llm.add_request(prompt, params, images=images)
    while not request.is_finished:
        llm.step()
    return list(request.output_token_ids), request.cached_tokens


CASES = {
    "text": ([[1, 2, 3, 4, 5]], []),
    "one-image": ([[10, 11], [12, 13, 14]], [(1, 4, 6)]),
    "two-images": ([[20], [21, 22], [23]], [(1, 8, 4), (1, 2, 2)]),
    "image-last": ([[30, 31, 32]], [(1, 6, 6)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(
    checkpoint: Path, reference: torch.nn.Module, case: str
) -> None:
    texts, grids = CASES[case]
    if case == "image-last":
        texts = [*texts, []]
    images = [random_image(grid, seed=i) for i, grid in enumerate(grids)]
    prompt = image_prompt(texts, images)
    with single_torch_thread():
        expected = hf_vl_greedy(reference, prompt, images, NEW_TOKENS)
        llm = _llm(checkpoint)
        got, _ = _run(llm, prompt, images)
    assert got == expected
    llm.check_conservation()


def test_prefix_cache_keys_images_by_content(checkpoint: Path, reference: torch.nn.Module) -> None:
    first, other = random_image((1, 8, 8), seed=7), random_image((1, 8, 8), seed=8)
    prompt = image_prompt([[40, 41, 42, 43, 44, 45, 46, 47], [48, 49]], [first])
    with single_torch_thread():
        llm = _llm(checkpoint)
        out_first, cached = _run(llm, prompt, [first])
        assert cached == 0
        again, cached_again = _run(llm, prompt, [first])
        assert again == out_first and cached_again >= 16  # the image's blocks were hits
        # same size, same placeholders, other pixels: only the text before it may hit
        out_other, cached_other = _run(llm, prompt, [other])
        assert cached_other == 8
        assert out_other == hf_vl_greedy(reference, prompt, [other], NEW_TOKENS)
    llm.check_conservation()


def test_reused_seat_starts_from_a_clean_delta(
    checkpoint: Path, reference: torch.nn.Module
) -> None:
    image = random_image((1, 8, 8), seed=3)
    text = [50, 51, 52, 53, 54, 55]
    with single_torch_thread():
        llm = _llm(checkpoint, max_batch_size=1)  # one seat: the text request takes the same one
        _run(llm, image_prompt([[60], [61]], [image]), [image])
        deltas = llm.core.seq_slot_manager.mrope_deltas
        deltas.check_conservation()  # cleared when its seat went back
        got, _ = _run(llm, text, [])
        assert got == hf_vl_greedy(reference, text, [], NEW_TOKENS)
    llm.check_conservation()


def test_placeholders_and_images_must_agree(checkpoint: Path) -> None:
    image = random_image((1, 4, 4), seed=1)
    llm = _llm(checkpoint)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(RequestRejected, match="no images"):
        llm.add_request([1, IMAGE_TOKEN, 2], params)
    with pytest.raises(RequestRejected, match="placeholder"):
        llm.add_request([1, IMAGE_TOKEN, 2], params, images=[image])  # needs 4 placeholders
    with pytest.raises(RequestRejected, match="2 image placeholders for 1 images"):
        llm.add_request([IMAGE_TOKEN] * 4 + [1] + [IMAGE_TOKEN] * 4, params, images=[image])
    llm.check_conservation()


def test_preempted_image_requests_recompute_exactly(
    checkpoint: Path, reference: torch.nn.Module
) -> None:
    """A pool too small for three image requests at once: the newest is preempted (its blocks
    and seat released, its delta row cleared) and recomputes its prompt, images included, on
    readmission; every answer is still transformers'."""
    new_tokens = 40
    images = [random_image((1, 6, 6), seed=20 + i) for i in range(3)]
    prompts = [
        image_prompt([[70 + i, 71], [72, 73 + i]], [image]) for i, image in enumerate(images)
    ]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with single_torch_thread():
        pairs = list(zip(prompts, images, strict=True))
        expected = [hf_vl_greedy(reference, p, [im], new_tokens) for p, im in pairs]
        llm = _llm(checkpoint, num_kv_blocks=14, max_batch_size=3)  # 112 tokens: two fit, not three
        requests = [llm.add_request(p, params, images=[im]) for p, im in pairs]
        while not all(r.is_finished for r in requests):
            llm.step()
    assert [list(r.output_token_ids) for r in requests] == expected
    assert any(r.num_preemptions for r in requests)
    llm.check_conservation()


def test_image_decode_steps_take_the_graph_path(
    checkpoint: Path, reference: torch.nn.Module
) -> None:
    """Decode steps of image requests batched with a text request go through the CUDA-graph
    decode path (capture off on CPU: the same padded static batch), each row's rope turned by
    its seat's delta; every answer equals transformers'."""
    cases = [CASES[name] for name in ("text", "one-image", "two-images")]
    prompts, all_images = [], []
    for i, (texts, grids) in enumerate(cases):
        images = [random_image(grid, seed=10 * i + j) for j, grid in enumerate(grids)]
        prompts.append(image_prompt(texts, images))
        all_images.append(images)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with single_torch_thread():
        expected = [
            hf_vl_greedy(reference, p, im, NEW_TOKENS)
            for p, im in zip(prompts, all_images, strict=True)
        ]
        llm = _llm(checkpoint)
        runner = pad_decode_steps(llm.core, 64)
        requests = [
            llm.add_request(p, params, images=im) for p, im in zip(prompts, all_images, strict=True)
        ]
        by_id = {r.request_id: r for r in requests}
        assert min(r.mrope_delta for r in requests) < 0  # the images shift positions
        turned = 0  # padded steps in which some row's rope position is not its index
        while not all(r.is_finished for r in requests):
            before = runner.num_eager_padded
            llm.step()
            plan = runner.last_plan
            if runner.num_eager_padded > before and plan is not None:
                real = range(plan.num_real)
                offsets = [plan.rope_positions[i] - plan.positions[i] for i in real]
                # each row turned by its own request's delta (0 for the text request), as
                # its seat's delta row held it (cleared once the request ends)
                assert offsets == [by_id[plan.request_ids[i]].mrope_delta for i in real]
                turned += any(offsets)
    assert [list(r.output_token_ids) for r in requests] == expected
    assert turned > 0, "no image request decoded through the graph path"
    llm.check_conservation()


def test_mrope_with_equal_axes_is_one_axis_rope_to_the_bit(checkpoint: Path) -> None:
    """Why a decode token may carry index + delta on one axis: its three axes are equal, and
    the mRoPE tables of equal axes are the one-axis tables, bit for bit."""
    rotary = load_model(str(checkpoint), dtype=torch.float32).model.model.rotary_emb
    positions = torch.arange(-5, 300)
    for dtype in (torch.float32, torch.bfloat16):
        one = rotary(positions, dtype)
        three = rotary(positions.expand(3, -1), dtype)
        assert all(torch.equal(a, b) for a, b in zip(one, three, strict=True))
