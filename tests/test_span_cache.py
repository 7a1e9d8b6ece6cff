"""transfer.span_cache: iov lists from cached layer-0 spans equal KvLayout.block_spans'."""

from __future__ import annotations

import numpy as np
import pytest

from shared.kv.layout import KvLayout
from transfer import ucp
from transfer.span_cache import SpanCache

LAYOUT = KvLayout(num_layers=5, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
NUM_BLOCKS = 12


@pytest.mark.parametrize("ids", [(3,), (0, 1, 2, 7), (11, 4, 5, 6, 0), (9, 8, 2, 3)])
@pytest.mark.parametrize(("layer", "n_layers"), [(0, 1), (3, 1), (4, 1), (0, 5), (1, 3)])
def test_iov_equals_block_spans(ids: tuple[int, ...], layer: int, n_layers: int) -> None:
    cache = SpanCache(LAYOUT, NUM_BLOCKS)
    base = 1 << 20
    for _ in range(2):  # a miss, then a hit
        got = cache.iov(base, layer, n_layers, ids)
        want = ucp.iov(base, LAYOUT.block_spans(NUM_BLOCKS, layer, n_layers, ids))
        assert np.array_equal(got, want)


def test_rejects_what_block_spans_rejects() -> None:
    cache = SpanCache(LAYOUT, NUM_BLOCKS)
    with pytest.raises(ValueError):
        cache.iov(0, 0, 1, (NUM_BLOCKS,))
    with pytest.raises(ValueError):
        cache.iov(0, 4, 2, (1,))
    with pytest.raises(ValueError):
        cache.iov(0, 0, 1, ())


def test_bounded_in_bytes() -> None:
    cache = SpanCache(LAYOUT, NUM_BLOCKS, max_bytes=200)
    for b in range(NUM_BLOCKS):
        cache.iov(0, 0, 1, (b,))  # 2 planes x 16 B + 8 B of key = 40 B each
    assert cache._bytes <= 200
    assert len(cache._entries) == 5
    assert (NUM_BLOCKS - 1,) in cache._entries and (0,) not in cache._entries
