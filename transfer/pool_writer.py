"""Where a validated payload's bytes go: straight into the pool blocks (CPU pools: one UCX receive
over an iov list from `transfer.span_cache`), or into a device staging buffer that is then
scattered into the blocks (CUDA pools: UCX does not order its copies with torch streams)."""

from __future__ import annotations

import asyncio

import torch

from shared.kv.layout import KvLayout
from transfer.landing import Announced
from transfer.span_cache import SpanCache
from transfer.ucp import Probe
from transfer.worker import UcxWorker


class PoolWriter:
    def __init__(self, kv_pool: torch.Tensor, layout: KvLayout) -> None:
        layout.check_pool(kv_pool)
        self.pool = kv_pool
        self._layout = layout
        self._stream: object | None = None  # torch.cuda.Stream for CUDA pools
        self._spans = SpanCache(layout, kv_pool.shape[2])

    def start(self) -> None:
        """On the loop thread, before its UCX worker exists."""
        if self.pool.is_cuda:
            torch.cuda.set_device(self.pool.device)  # UCX needs the context current here
            self._stream = torch.cuda.Stream(self.pool.device)

    def post(
        self, worker: UcxWorker, probe: Probe, a: Announced
    ) -> tuple[asyncio.Future, torch.Tensor | None]:
        """Post the receive of `probe` for `a`'s blocks; returns its future and the staging
        buffer to `land` once it completed (None: the bytes are in the blocks already)."""
        pool = self.pool
        if pool.is_cuda:
            staging = torch.empty(a.nbytes, dtype=torch.uint8, device=pool.device)
            return worker.recv_probed(probe, staging), staging
        iov = self._spans.iov(pool.data_ptr(), a.layer, a.n_layers, a.ids)
        return worker.recv_probed_iov(probe, iov, pool), None

    def land(self, a: Announced, staging: torch.Tensor | None) -> None:
        """CUDA pools: copy a landed staging buffer into its blocks (synchronously: the blocks
        are complete before anyone reads them)."""
        if staging is None:
            return
        shape = self._layout.payload_shape(a.n_layers, len(a.ids))
        payload = staging.view(self.pool.dtype).view(shape)
        index = torch.tensor(a.ids, dtype=torch.long).to(self.pool.device)
        with torch.cuda.stream(self._stream):
            for i in range(a.n_layers):
                self.pool[a.layer + i].index_copy_(1, index, payload[i])
        self._stream.synchronize()
