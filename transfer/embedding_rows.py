"""Rows of embeddings (an image's vision-tower output, one row per placeholder token) moved by
the KV push: the landing area is a KV pool of one layer and one plane whose blocks hold
`block_rows` rows of `hidden` float32 values, so the transfer plane's grants, token-keyed
headers and verified landings carry embeddings unchanged. Both ends build the layout from the
same two numbers; its fingerprint, in every header, catches a disagreement."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from shared.kv.layout import KvLayout


def embedding_layout(hidden: int, block_rows: int) -> KvLayout:
    return KvLayout(
        num_layers=1,
        num_kv_heads=1,
        head_dim=hidden,
        block_size=block_rows,
        dtype="float32",
        planes=1,
    )


def blocks_for(rows: int, block_rows: int) -> int:
    return -(-rows // block_rows)


def pack_rows(arrays: Sequence[np.ndarray], layout: KvLayout) -> torch.Tensor:
    """The arrays' rows, in order, as one message's payload (planes, blocks, block_rows, 1,
    hidden); rows past the last array are zero."""
    rows = sum(a.shape[0] for a in arrays)
    n = blocks_for(rows, layout.block_size)
    payload = torch.zeros(layout.payload_shape(1, n)[1:], dtype=torch.float32)
    flat = payload.view(-1, layout.head_dim)
    at = 0
    for a in arrays:
        flat[at : at + a.shape[0]] = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
        at += a.shape[0]
    return payload


def unpack_rows(
    pool: torch.Tensor, block_ids: Sequence[int], counts: Sequence[int]
) -> list[np.ndarray]:
    """Copies of the landed rows, one array of counts[i] rows per image, read in order from
    `block_ids` of a landing pool (embedding_layout's pool_shape)."""
    hidden = pool.shape[-1]
    # the index gathers the blocks into a tensor of its own: the images' arrays are views of
    # it, so the pool's blocks may be granted again once this returns
    flat = pool[0, 0, list(block_ids)].reshape(-1, hidden)
    out, at = [], 0
    for n in counts:
        out.append(flat[at : at + n].numpy())
        at += n
    return out
