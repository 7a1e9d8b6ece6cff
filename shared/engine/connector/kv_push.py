"""The prefill side of P/D behind the connector: a request's KV leaves through the node's layer
hook while its prompt computes, and its blocks stay pinned from the end of its context until
the node reports the push over (`release`), so nothing evicts or reuses them mid-send.

The node hands in `layer_hooks`, the factory that plans each step's sends (prefill_node/push.py,
which holds the UCX side); the engine never sees what moves the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.engine.requests.request import LlmRequest
from shared.engine.resources.resource_manager import KVCacheManager
from shared.engine.scheduling.scheduler import ScheduledRequest
from shared.model.step_context import LayerHook

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KvAccess:
    """What a push needs from the KV manager on the engine thread: a request's blocks, and a
    pin that keeps the blocks being sent from eviction and reuse."""

    block_table: Callable[[str], list[int]]
    pin_blocks: Callable[[str, Sequence[int]], None]


# Called on the engine thread with a step's scheduled requests (before their counters advance);
# returns the hook the model calls after each layer's K/V are written, or None.
LayerHookFactory = Callable[[Sequence[ScheduledRequest], KvAccess], LayerHook | None]


class KvPushConnector:
    def __init__(self, kv: KVCacheManager, layer_hooks: LayerHookFactory | None = None):
        self._kv = kv
        self._layer_hooks = layer_hooks
        self._access = KvAccess(kv.block_table, kv.pin_blocks)

    # ---- scheduler side: every prompt is computed here ------------------------------------
    def external_tokens(self, request: LlmRequest, local_tokens: int) -> int:
        return 0

    def after_allocate(self, request: LlmRequest, blocks: Sequence[int]) -> None:
        raise RuntimeError("a prefill node loads no KV from outside")

    def finish_load(self, request: LlmRequest) -> None:
        raise RuntimeError("a prefill node loads no KV from outside")

    def request_finished(self, request: LlmRequest) -> bool:
        """The context is computed: every block of it stays pinned for the push."""
        rid = request.request_id
        self._kv.pin_blocks(rid, self._kv.block_table(rid))
        return True

    def release(self, request_id: str) -> None:
        """The push ended (ok or not): unpin; the blocks stay in the prefix cache."""
        self._kv.unpin_request(request_id)

    # ---- model side -----------------------------------------------------------------------
    def register_kv_pool(self, pool: torch.Tensor) -> None:
        pass  # the node's push hook reads the pool through the memory EngineInfo hands it

    def start_load_kv(self, scheduled: Sequence[ScheduledRequest]) -> None:
        pass

    def layer_hook(self, scheduled: Sequence[ScheduledRequest]) -> LayerHook | None:
        if self._layer_hooks is None:
            return None
        return self._layer_hooks(scheduled, self._access)

    def wait_for_save(self) -> None:
        """Nothing to wait for: sends read pinned blocks, which no later step can overwrite."""

    def offload_blocks(self) -> int:
        return 0

    def shutdown(self) -> None:
        """Nothing kept: a push not finished by now has failed, and its request was released."""
