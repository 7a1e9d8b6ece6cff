"""Prompt images on the node-to-node wire: a round trip keeps the bytes, the grid and the
content key (recomputed, not trusted); malformed or oversized images, and images for a text
model, are WireErrors naming the image."""

from __future__ import annotations

import numpy as np
import pytest

from proto.pdserve.v1 import prefill_pb2
from shared.model.vision.image_processor import ImageProcessorConfig
from shared.serving.wire import WireError
from shared.serving.wire_images import images_from_proto, images_to_proto
from tests.support.vision_checkpoints import random_image

PROCESSOR = ImageProcessorConfig(
    patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=64, max_pixels=48 * 48
)


def test_round_trip_keeps_pixels_grid_and_key() -> None:
    images = [random_image((1, 4, 6), seed=1), random_image((1, 2, 2), seed=2)]
    back = images_from_proto(images_to_proto(images), PROCESSOR)
    for sent, got in zip(images, back, strict=True):
        assert np.array_equal(sent.rgb, got.rgb) and sent.grid == got.grid
    assert back[0].digest != back[1].digest
    assert images_from_proto(images_to_proto(images), PROCESSOR)[0].digest == back[0].digest


@pytest.mark.parametrize(
    ("image", "words"),
    [
        (prefill_pb2.PromptImage(rgb=b"\0" * 10, height=8, width=8), "bytes for 8x8"),
        (prefill_pb2.PromptImage(rgb=b"\0" * 300, height=10, width=10), "multiple of 8"),
        (prefill_pb2.PromptImage(rgb=b"", height=64, width=64), "over the model's"),
    ],
)
def test_malformed_images_are_refused_by_name(image: prefill_pb2.PromptImage, words: str) -> None:
    good = images_to_proto([random_image((1, 2, 2), seed=3)])[0]
    with pytest.raises(WireError, match=f"image 2: .*{words}"):
        images_from_proto([good, image], PROCESSOR)


def test_a_text_model_takes_no_images() -> None:
    with pytest.raises(WireError, match="text only"):
        images_from_proto(images_to_proto([random_image((1, 2, 2), seed=4)]), None)
    assert images_from_proto([], None) == []


def test_model_info_names_the_image_placeholder_of_vision_models_only() -> None:
    from shared.engine.config import EngineConfig
    from shared.engine.llm import LLM
    from shared.serving.grpc_server import image_placeholder

    text_model = LLM(EngineConfig(model="tiny", num_kv_blocks=64)).core.info
    assert image_placeholder(text_model) == ""
