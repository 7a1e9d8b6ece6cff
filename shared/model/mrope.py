"""Where each prompt token sits for mRoPE (Qwen2-VL, Qwen2.5-VL): three position axes (time,
height, width), as transformers' `Qwen2VLModel.get_rope_index` assigns them for images.

Text tokens advance all three axes together. An image's tokens (its merged patches, row-major)
share the time position and take their row and column, offset by where the image starts; the
text after it resumes at that start plus the larger of the image's merged height and width. So
after an image the next position is not the token count: the difference is the request's
*delta*, constant from the end of the prompt on (every generated token sits at its index plus
the delta), which is why a decode step needs only the delta, never the prompt's positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Grid = tuple[int, int, int]  # (t, h, w) in patches, before the spatial merge


@dataclass(frozen=True)
class ImageSpan:
    """One image's run of placeholder tokens in a prompt."""

    start: int  # index of its first token
    grid: Grid
    merge: int  # the spatial merge size: tokens are (h / merge) x (w / merge) per frame

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * (h // self.merge) * (w // self.merge)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


def image_token_count(grid: Grid, merge: int) -> int:
    """Placeholder tokens an image of `grid` patches takes in the prompt."""
    return ImageSpan(0, grid, merge).num_tokens


def image_spans(
    token_ids: Sequence[int], image_token_id: int, grids: Sequence[Grid], merge: int
) -> list[ImageSpan]:
    """Each image's span: the i-th run of `image_token_id` tokens belongs to image i and must
    hold exactly its token count (ValueError otherwise: the prompt and its images disagree)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    is_image = np.concatenate(([False], ids == image_token_id, [False]))
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    runs = list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))
    if len(runs) != len(grids):
        raise ValueError(f"the prompt has {len(runs)} image placeholders for {len(grids)} images")
    spans = []
    for i, ((start, end), grid) in enumerate(zip(runs, grids, strict=True)):
        span = ImageSpan(start, tuple(grid), merge)  # type: ignore[arg-type]
        if span.num_tokens != end - start:
            raise ValueError(
                f"image {i + 1} takes {span.num_tokens} placeholder tokens, the prompt has "
                f"{end - start}"
            )
        spans.append(span)
    return spans


def mrope_positions(length: int, spans: Sequence[ImageSpan]) -> tuple[np.ndarray, int]:
    """([3, length] int64 positions of a prompt's tokens, delta of the tokens after it)."""
    positions = np.empty((3, length), dtype=np.int64)
    cursor = token = 0
    for span in spans:
        text = span.start - token
        positions[:, token : span.start] = np.arange(cursor, cursor + text)
        cursor += text
        t, h, w = span.grid
        rows, cols = h // span.merge, w // span.merge
        grid = np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols), indexing="ij")
        positions[:, span.start : span.end] = np.stack([g.reshape(-1) for g in grid]) + cursor
        cursor += max(rows, cols)
        token = span.end
    positions[:, token:] = np.arange(cursor, cursor + length - token)
    cursor += length - token
    return positions, cursor - length
