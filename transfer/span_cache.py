"""iov lists over a KV pool's blocks, from layer 0's spans kept per block list.

A layer-wise push sends every layer of a chunk's blocks, and both sides used to rebuild the
spans for each message (`KvLayout.block_spans`: ~0.15 ms of numpy on a busy core, per message,
on each side). Layer l's spans are layer 0's moved by l layer strides, so one entry per block
list serves every layer and every run of layers. Bounded in bytes; least recently used goes.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from shared.kv.layout import KvLayout
from transfer import ucp

MAX_BYTES = 4 << 20  # of cached offsets and lengths (16 bytes per span)


class SpanCache:
    def __init__(self, layout: KvLayout, num_blocks: int, max_bytes: int = MAX_BYTES) -> None:
        self._layout = layout
        self.num_blocks = num_blocks
        self._stride = layout.layer_stride_bytes(num_blocks)
        self._max = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def iov(self, base: int, layer: int, n_layers: int, ids: tuple[int, ...]) -> np.ndarray:
        """The iov (ucp.IOV_DTYPE) over pool[layer : layer + n_layers][:, :, ids] of the pool at
        address `base`, in payload order. Raises ValueError for layers or ids outside the pool."""
        if not (layer >= 0 and n_layers >= 1 and layer + n_layers <= self._layout.num_layers):
            raise ValueError(
                f"layers {layer}..+{n_layers} outside 0..{self._layout.num_layers - 1}"
            )
        offsets, lengths = self._spans0(ids)
        start = base + layer * self._stride
        if n_layers == 1:
            return ucp.iov(start, (offsets, lengths))
        shift = np.arange(n_layers, dtype=np.int64)[:, None] * self._stride
        many = (shift + offsets[None, :]).reshape(-1)
        return ucp.iov(start, (many, np.tile(lengths, n_layers)))

    def _spans0(self, ids: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        spans = self._entries.get(ids)
        if spans is not None:
            self._entries.move_to_end(ids)
            return spans
        spans = self._layout.block_spans(self.num_blocks, 0, 1, ids)  # checks the ids
        size = spans[0].nbytes + spans[1].nbytes + 8 * len(ids)  # the key: a pointer per id
        if size <= self._max:
            self._entries[ids] = spans
            self._bytes += size
            while self._bytes > self._max:
                key, (o, n) = self._entries.popitem(last=False)
                self._bytes -= o.nbytes + n.nbytes + 8 * len(key)
        return spans
