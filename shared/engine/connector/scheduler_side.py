"""The scheduler side of a KV connector (shared/engine/connector/base.py): bookkeeping on the
engine thread, no torch and no I/O. The scheduler holds a connector through this side alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from shared.engine.requests.request import LlmRequest


class KvConnectorScheduler(Protocol):
    def external_tokens(self, request: LlmRequest, local_tokens: int) -> int:
        """Prompt tokens past `local_tokens` (this pool's prefix hit) that an external source
        will write into this pool for `request`; 0: the engine computes them."""
        ...

    def after_allocate(self, request: LlmRequest, blocks: Sequence[int]) -> None:
        """`blocks` were reserved for the external tokens: hold them for the writer."""
        ...

    def finish_load(self, request: LlmRequest) -> None:
        """Every external token of `request` is in the pool: its blocks are computed KV now."""
        ...

    def request_finished(self, request: LlmRequest) -> bool:
        """`request`'s context is done here: True when its blocks must stay held (being saved
        elsewhere) until `release(request_id)`."""
        ...

    def release(self, request_id: str) -> None:
        """The save `request_finished` held blocks for is over (ok or not)."""
        ...
