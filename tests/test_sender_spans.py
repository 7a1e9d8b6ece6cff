"""A push's iov over its CPU pool (transfer/sender.py:KvPush._pool_iov): a layer-wise push sends
every layer of one chunk's blocks, so layer 0's spans are kept while messages name the same block
tuples; lists (which may change between messages) are never kept."""

from __future__ import annotations

import torch

from shared.kv.layout import KvLayout
from shared.kv.pool import allocate_kv_pool
from transfer import ucp
from transfer.protocol import TransferDestination
from transfer.ucx import KvMessage, KvSender

LAYOUT = KvLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
BLOCKS = 16


def _push():
    pool = allocate_kv_pool(LAYOUT, BLOCKS, "cpu")
    dest = TransferDestination(
        "127.0.0.1:9", 7, b"t" * 16, tuple(range(BLOCKS)), LAYOUT.fingerprint()
    )
    return KvSender(LAYOUT).open(dest, pool), pool


def _want(pool: torch.Tensor, layer: int, n_layers: int, src) -> list:
    spans = LAYOUT.block_spans(BLOCKS, layer, n_layers, list(src))
    return ucp.iov(pool.data_ptr(), spans).tolist()


def test_the_same_block_tuples_reuse_layer_zero_spans() -> None:
    push, pool = _push()
    src, dst = (3, 4, 9, 10), (0, 1, 2, 3)
    for layer in (0, 2, 1):
        ids, iov, source = push._prepare(KvMessage(layer=layer, blocks=dst, src=src))
        assert ids == dst and source is pool
        assert iov.tolist() == _want(pool, layer, 1, src)
    assert push._last is not None and push._last.src is src
    _, iov, _ = push._prepare(KvMessage(layer=1, blocks=dst, src=src, n_layers=2))
    assert iov.tolist() == _want(pool, 1, 2, src)
    other = (5, 6, 7, 8)  # new tuples: new spans
    _, iov, _ = push._prepare(KvMessage(layer=2, blocks=dst, src=other))
    assert iov.tolist() == _want(pool, 2, 1, other)


def test_lists_are_read_again_every_message() -> None:
    push, pool = _push()
    blocks, src = [0, 1], [7, 8]
    push._prepare(KvMessage(layer=0, blocks=blocks, src=src))
    src[1] = 12  # the caller reuses its list
    _, iov, _ = push._prepare(KvMessage(layer=1, blocks=blocks, src=src))
    assert iov.tolist() == _want(pool, 1, 1, [7, 12])
    assert push._last is None
