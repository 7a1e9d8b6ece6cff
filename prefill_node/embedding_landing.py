"""Where encoder nodes push a prompt's image embeddings (E/P/D): a float32 area in this prefill
node's memory, registered with UCX once at start, and the KV receiver that lands pushes in it.

Each Encode call is granted the blocks its images' rows need, under a one-time token, for at
most its deadline; the encoder pushes the rows as one KV message (transfer/embedding_rows.py),
so the transfer plane's guarantees hold unchanged: only the token's holder writes, only into
the blocks granted, and the rows are read only once the whole push has landed. The rows are
copied out and the blocks freed before the prompt runs; an area too full for a call's images
sends that call the bytes way (`EncodeResponse.embeddings`) instead of waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from prefill_node.landing_blocks import LandingBlocks
from shared.kv.pool import allocate_kv_pool
from transfer.embedding_rows import blocks_for, embedding_layout, unpack_rows
from transfer.protocol import TransferDestination
from transfer.ucx import KvReceiver

log = logging.getLogger(__name__)

# rows per block: an image is tens to thousands of rows, so a few blocks per call
BLOCK_ROWS = 64
# how long a failed or cancelled push may keep writing before its blocks are forced free
FENCE_TIMEOUT_S = 5.0


class EmbeddingLanding:
    def __init__(
        self,
        hidden: int,
        capacity_bytes: int,
        host: str,
        port: int = 0,
        bind_host: str | None = None,
        instance_id: int = 0,
    ) -> None:
        self.layout = embedding_layout(hidden, BLOCK_ROWS)
        num_blocks = max(1, capacity_bytes // self.layout.block_bytes_per_layer)
        self.pool = allocate_kv_pool(self.layout, num_blocks, "cpu")
        self.blocks = LandingBlocks(num_blocks)
        self.receiver = KvReceiver(self.pool, self.layout, host, port, bind_host, instance_id)

    async def start(self) -> None:
        await self.receiver.start()

    async def close(self) -> None:
        await self.receiver.close()

    def grant(self, request_id: str, rows: int, lease: float) -> TransferDestination | None:
        """A destination for `rows` rows, valid for `lease` seconds; None when the area has
        not that many blocks free."""
        ids = self.blocks.take(blocks_for(rows, BLOCK_ROWS))
        if ids is None:
            return None
        return self.receiver.expect(request_id, ids, lease=lease)

    async def collect(
        self, dest: TransferDestination, counts: Sequence[int], timeout: float
    ) -> list[np.ndarray]:
        """The pushed rows, counts[i] for image i, once every block has landed (TransferError,
        TransferTimeout otherwise)."""
        await self.receiver.wait(dest.transfer_id, timeout)
        return unpack_rows(self.pool, dest.block_ids, counts)

    async def release(self, dest: TransferDestination) -> None:
        """The grant ends: its blocks free once no write can reach them."""
        try:
            await self.receiver.release(dest.transfer_id, FENCE_TIMEOUT_S)
        except TimeoutError:
            log.error("landing %#x never quiesced: its blocks stay out of use", dest.transfer_id)
            self.blocks.quarantine(dest.block_ids)
            return
        self.blocks.give_back(dest.block_ids)
