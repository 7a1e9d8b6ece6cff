"""The Qwen2-VL and Qwen2.5-VL vision towers against transformers' own, on tiny random models.

Weights are copied name for name from transformers' state dict (the `model.visual.` prefix it
holds in memory) or from its save_pretrained file (`visual.`, the published checkpoints'
spelling), each after `VisionConfig.from_hf` reads the config. Norm weights and biases are
randomised too, so a norm or bias that went missing would show.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from shared.model.vision.qwen2_5_vl_vision import window_order
from shared.model.vision.vision_config import VisionConfig
from shared.model.vision.vision_tower import build_vision_tower

transformers = pytest.importorskip("transformers")

TEXT = {
    "vocab_size": 64,
    "hidden_size": 48,  # the merger's output width: unlike the towers' widths
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rope_parameters": {"rope_type": "default", "mrope_section": [4, 5, 3], "rope_theta": 1e4},
}
QWEN2_VISION = {
    "depth": 3,
    "embed_dim": 32,
    "hidden_size": 48,
    "num_heads": 2,
    "mlp_ratio": 2,
    "patch_size": 14,
}
# 3 merged patches a window side (24 // 2 // 4); blocks 1 and 3 attend over whole frames
QWEN2_5_VISION = {
    "depth": 4,
    "hidden_size": 64,
    "out_hidden_size": 48,
    "intermediate_size": 80,
    "num_heads": 4,
    "patch_size": 4,
    "window_size": 24,
    "fullatt_block_indexes": [1, 3],
}
QWEN2_GRIDS = [[(1, 4, 6)], [(1, 4, 6), (1, 8, 4)], [(1, 4, 6), (1, 8, 4), (1, 2, 2)]]
# merged 5x3 and 4x6 split unevenly into 3x3 windows; a frame under one window; two frames
QWEN2_5_GRIDS = [[(1, 10, 6)], [(1, 10, 6), (1, 8, 12)], [(1, 8, 12), (1, 2, 2), (2, 6, 4)]]
KINDS = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLConfig", QWEN2_VISION, QWEN2_GRIDS),
    "qwen2_5_vl": (
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLConfig",
        QWEN2_5_VISION,
        QWEN2_5_GRIDS,
    ),
}


def randomise(model: nn.Module, generator: torch.Generator) -> None:
    """Weights at unit-gain scale, norm weights around 1, biases around 0: none trivial."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if p.dim() >= 2:
                p.copy_(noise / (p[0].numel() ** 0.5))
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(1.0 + 0.2 * noise)


@pytest.fixture(scope="module", params=list(KINDS))
def reference(request: pytest.FixtureRequest) -> tuple[str, nn.Module]:
    """(kind, transformers' model with random weights), fp32."""
    model_name, config_name, vision, _ = KINDS[request.param]
    config = getattr(transformers, config_name)(text_config=TEXT, vision_config=vision)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    randomise(model.model.visual, torch.Generator().manual_seed(1))
    return request.param, model


def stripped(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}


def load_tower(
    vision_config: Mapping[str, Any],
    kind: str,
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
) -> nn.Module:
    tower = build_vision_tower(
        VisionConfig.from_hf(vision_config, kind), torch.device("cpu"), dtype
    )
    assert set(tower.state_dict()) == set(state)  # every checkpoint key, and no other
    tower.load_state_dict(state, strict=True)
    return tower


def pixels(kind: str, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    patch_size = KINDS[kind][2]["patch_size"]
    patches = sum(t * h * w for t, h, w in grids)
    generator = torch.Generator().manual_seed(len(grids))
    return torch.randn(patches, 3 * 2 * patch_size**2, generator=generator)


def expected(model: nn.Module, pixel_values: torch.Tensor, grids: list) -> torch.Tensor:
    with torch.no_grad():
        return model.model.visual(pixel_values, grid_thw=torch.tensor(grids)).pooler_output


@pytest.mark.parametrize("images", [1, 2, 3])
def test_matches_transformers_fp32(reference: tuple[str, nn.Module], images: int) -> None:
    kind, model = reference
    vision_config = model.config.to_dict()["vision_config"]
    tower = load_tower(
        vision_config, kind, stripped(model.state_dict(), "model.visual."), model.dtype
    )
    grids = KINDS[kind][3][images - 1]
    pixel_values = pixels(kind, grids)
    want = expected(model, pixel_values, grids)
    got = tower(pixel_values, grids)
    assert got.shape == (sum(t * h * w for t, h, w in grids) // 4, TEXT["hidden_size"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def saved(reference: tuple[str, nn.Module], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference model written by save_pretrained."""
    path = tmp_path_factory.mktemp(reference[0])
    reference[1].save_pretrained(path)
    return path


def test_loads_the_saved_checkpoint_layout(reference: tuple[str, nn.Module], saved: Path) -> None:
    """save_pretrained writes the published layout (`visual.`, `model.layers.`, `lm_head.`) and
    a config.json whose `vision_config` from_hf reads as the in-memory config's."""
    kind, model = reference
    state = load_file(saved / "model.safetensors")
    assert not any(k.startswith("model.visual.") for k in state)
    assert {k.split(".")[0] for k in state} == {"visual", "model", "lm_head"}
    vision_config = transformers.AutoConfig.from_pretrained(saved).to_dict()["vision_config"]
    tower = load_tower(vision_config, kind, stripped(state, "visual."), torch.float32)
    grids = KINDS[kind][3][-1]
    pixel_values = pixels(kind, grids)
    torch.testing.assert_close(
        tower(pixel_values, grids), expected(model, pixel_values, grids), atol=1e-5, rtol=1e-5
    )


def test_matches_transformers_bf16(reference: tuple[str, nn.Module], saved: Path) -> None:
    """Loaded as a bf16 checkpoint is (from_pretrained keeps the rope's inverse frequencies in
    fp32; a model cast with `.to(bfloat16)` would round them). Here the bits agree; the bound
    leaves room for the patch embedding's matmul summing in another order than Conv3d."""
    kind, model = reference
    model_bf16 = type(model).from_pretrained(saved, dtype=torch.bfloat16).eval()
    vision_config = model.config.to_dict()["vision_config"]
    state = stripped(model_bf16.state_dict(), "model.visual.")
    tower = load_tower(vision_config, kind, state, torch.bfloat16)
    for grids in KINDS[kind][3]:
        pixel_values = pixels(kind, grids)
        got = tower(pixel_values, grids)
        assert got.dtype == torch.bfloat16
        want = expected(model_bf16, pixel_values, grids)
        torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)


def test_window_order_matches_transformers() -> None:
    from transformers.vision_utils import get_vision_window_index

    grids = [(1, 10, 6), (2, 8, 12), (1, 2, 2), (1, 12, 12)]
    order, lengths = window_order(grids, merge=2, window=3)
    want_order, want_cu = get_vision_window_index(
        torch.tensor(grids), spatial_merge_size=2, window_size=24, patch_size=4
    )
    assert order.tolist() == want_order.tolist()
    assert [0, *torch.tensor(lengths).cumsum(0).tolist()] == want_cu.tolist()


PUBLISHED_QWEN2_VL = {  # Qwen/Qwen2-VL-2B-Instruct's config.json
    "depth": 32,
    "embed_dim": 1280,
    "mlp_ratio": 4,
    "num_heads": 16,
    "in_chans": 3,
    "hidden_size": 1536,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "spatial_patch_size": 14,
    "temporal_patch_size": 2,
}
PUBLISHED_QWEN2_5_VL = {  # Qwen/Qwen2.5-VL-3B-Instruct's config.json
    "depth": 32,
    "hidden_act": "silu",
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_chans": 3,
    "out_hidden_size": 2048,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "spatial_patch_size": 14,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "tokens_per_second": 2,
    "temporal_patch_size": 2,
}


def test_reads_the_published_configs() -> None:
    qwen2 = VisionConfig.from_hf(PUBLISHED_QWEN2_VL, "qwen2_vl")
    assert (qwen2.embed_dim, qwen2.intermediate_size, qwen2.out_hidden_size) == (1280, 5120, 1536)
    assert (qwen2.hidden_act, qwen2.rope_theta, qwen2.patch_dim) == ("quick_gelu", 1e4, 1176)
    qwen25 = VisionConfig.from_hf(PUBLISHED_QWEN2_5_VL, "qwen2_5_vl")
    assert (qwen25.embed_dim, qwen25.intermediate_size, qwen25.out_hidden_size) == (
        1280,
        3420,
        2048,
    )
    assert (qwen25.window_merged, qwen25.fullatt_block_indexes) == (4, (7, 15, 23, 31))


@pytest.mark.parametrize(
    ("kind", "change", "message"),
    [
        ("qwen2_vl", {"embed_dim": 30, "num_heads": 4}, "not divisible by num_heads"),
        ("qwen2_vl", {"embed_dim": 24, "num_heads": 4}, "divisible by 4"),
        ("qwen2_vl", {"hidden_act": "relu"}, "unsupported hidden_act"),
        ("qwen2_vl", {"depth": 0}, "depth must be a positive int"),
        ("qwen2_vl", {"rope_parameters": {"rope_type": "yarn"}}, "axial"),
        ("qwen2_5_vl", {"window_size": 7}, "under one merged patch"),
        ("qwen2_5_vl", {"fullatt_block_indexes": [1, 4]}, r"\[4\] are outside the 4 blocks"),
        ("qwen2_6_vl", {}, "unknown vision tower kind"),
    ],
)
def test_bad_configs_are_refused(kind: str, change: dict, message: str) -> None:
    base = QWEN2_VISION if kind == "qwen2_vl" else QWEN2_5_VISION
    with pytest.raises(ValueError, match=message):
        VisionConfig.from_hf({**base, **change}, kind)


def test_inputs_that_disagree_with_the_grid_are_refused() -> None:
    tower = build_vision_tower(
        VisionConfig.from_hf(QWEN2_VISION, "qwen2_vl"), torch.device("cpu"), torch.float32
    )
    with pytest.raises(ValueError, match="multiples of 2"):
        tower(torch.zeros(12, 1176), [(1, 3, 4)])
    with pytest.raises(ValueError, match=r"pixel_values \(12, 1176\) != \(16, 1176\)"):
        tower(torch.zeros(12, 1176), [(1, 4, 4)])
