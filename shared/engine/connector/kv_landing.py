"""The decode side of P/D behind the connector: a prompt placed on a prefill node gets blocks
reserved here (minus this node's own prefix-cache hit) and pinned while the prefill node's
pushes land in them over the wire, outside any step; when the last byte has landed the blocks
are this request's computed KV, offered to the prefix cache like any other.

A request waits for a push when its decode role queued it for a transfer (`remote_prefill`);
every other request is computed here (`external_tokens` 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared.engine.requests.request import LlmRequest
from shared.engine.resources.resource_manager import KVCacheManager
from shared.engine.scheduling.scheduler import ScheduledRequest
from shared.model.step_context import LayerHook

if TYPE_CHECKING:
    import torch


class KvLandingConnector:
    def __init__(self, kv: KVCacheManager):
        self._kv = kv

    # ---- scheduler side -------------------------------------------------------------------
    def external_tokens(self, request: LlmRequest, local_tokens: int) -> int:
        """The prefill node computes every prompt token past this node's hit (its logprobs
        too: any hit here is usable)."""
        if not request.remote_prefill:
            return 0
        return request.prompt_len - local_tokens

    def after_allocate(self, request: LlmRequest, blocks: Sequence[int]) -> None:
        """Pinned until the push is over: neither eviction nor preemption may hand them on."""
        self._kv.pin_blocks(request.request_id, blocks)

    def finish_load(self, request: LlmRequest) -> None:
        request.remote_prefill = False  # landed: a preempted request recomputes it here
        self._kv.unpin_request(request.request_id)
        request.num_computed_tokens = request.prompt_len
        self._kv.cache_computed_blocks(request)

    def request_finished(self, request: LlmRequest) -> bool:
        return False

    def release(self, request_id: str) -> None:
        pass

    # ---- model side: the pushes land outside steps ----------------------------------------
    def register_kv_pool(self, pool: torch.Tensor) -> None:
        pass  # the node's receiver writes the pool through the memory EngineInfo hands it

    def start_load_kv(self, scheduled: Sequence[ScheduledRequest]) -> None:
        pass

    def layer_hook(self, scheduled: Sequence[ScheduledRequest]) -> LayerHook | None:
        return None

    def wait_for_save(self) -> None:
        pass

    def offload_blocks(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass
