"""A prompt's images as the engine keeps them: each image resized as the model takes it (RGB
bytes: the float pixels the tower reads are made from them when it runs, eight times larger),
where its placeholder tokens sit, and the prompt's mRoPE positions (shared/model/mrope.py).

The bytes stay with the request while it lives (a preempted request computes its prompt
again); the embeddings the vision tower makes of them live in the model runner's encoder cache,
bounded in bytes, keyed by each image's digest. The digest also keys the prefix cache: the
placeholder tokens are the same for every image, so a block's hash takes the image's digest in
their place, and a repeated image (same pixels, same place) is a prefix hit while another image
of the same size is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from shared.model.mrope import Grid, ImageSpan, image_spans, mrope_positions


@dataclass(frozen=True, eq=False)
class PromptImage:
    """One image, resized: [height, width, 3] uint8, sides multiples of the merged patch."""

    rgb: np.ndarray
    grid: Grid  # its (t, h, w) patches
    digest: bytes  # of the bytes and the grid: equal images, equal digests
    # [tokens, hidden] float32 made by an encoder node (E/P/D): the tower's output, which the
    # engine then takes instead of running its own; None: the engine encodes it
    embeddings: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return int(self.rgb.nbytes)

    def encoded(self, embeddings: np.ndarray) -> PromptImage:
        """This image with the encoder node's embeddings."""
        return replace(self, embeddings=embeddings)


@dataclass(frozen=True, eq=False)
class MultimodalPrompt:
    images: tuple[PromptImage, ...]
    spans: tuple[ImageSpan, ...]
    positions: np.ndarray  # [3, prompt_len] int64 mRoPE positions
    delta: int  # position minus index of every token after the prompt

    @classmethod
    def build(
        cls,
        prompt: Sequence[int],
        images: Sequence[PromptImage],
        image_token_id: int,
        merge: int,
    ) -> MultimodalPrompt:
        """ValueError when the prompt's placeholders and the images disagree."""
        spans = image_spans(prompt, image_token_id, [image.grid for image in images], merge)
        positions, delta = mrope_positions(len(prompt), spans)
        return cls(tuple(images), tuple(spans), positions, delta)

    def hash_token_ids(self, token_ids: Sequence[int]) -> list[int]:
        """`token_ids` (the request's, from its start) with each image's placeholders replaced
        by a value of its digest: negative, so no real token id equals one."""
        ids = list(token_ids)
        for image, span in zip(self.images, self.spans, strict=True):
            if span.start >= len(ids):
                break
            key = -1 - int.from_bytes(image.digest[:7], "little")
            stop = min(span.end, len(ids))
            ids[span.start : stop] = [key] * (stop - span.start)
        return ids

    def prompt_positions(self, start: int, stop: int) -> np.ndarray:
        """[3, stop - start] positions of prompt tokens [start, stop)."""
        return self.positions[:, start:stop]
