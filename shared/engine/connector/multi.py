"""Several KV connectors as one (vLLM's MultiConnector): a P/D connector and an offload tier on
the same node.

A fresh request's external tokens come from the first connector that supplies any (a decode
node's landing connector for a prompt a prefill node computes, else the tier); that one gets
its `after_allocate` and `finish_load`. Every connector sees every step (`start_load_kv`, its
layer hook, `wait_for_save`); a finished request's blocks stay held while any connector holds
them, and `release` goes to all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared.engine.requests.request import LlmRequest
from shared.engine.scheduling.scheduler import ScheduledRequest
from shared.model.step_context import LayerHook

if TYPE_CHECKING:
    import torch

    from shared.engine.connector.base import KvConnector

PRUNE_AT = 1024  # loads routed and not yet finished: past it, ended requests' entries go


class MultiConnector:
    def __init__(self, connectors: Sequence[KvConnector]):
        self.connectors = list(connectors)
        # rid -> who supplies its external tokens, and the request (an entry whose request
        # ended without its load finishing, a failed transfer, is pruned: `_prune`)
        self._source: dict[str, tuple[KvConnector, LlmRequest]] = {}
        self._asked: KvConnector | None = None

    def register_kv_pool(self, pool: torch.Tensor) -> None:
        for c in self.connectors:
            c.register_kv_pool(pool)

    # ---- scheduler side -------------------------------------------------------------------
    def external_tokens(self, request: LlmRequest, local_tokens: int) -> int:
        self._asked = None
        for c in self.connectors:
            tokens = c.external_tokens(request, local_tokens)
            if tokens:
                self._asked = c
                return tokens
        return 0

    def after_allocate(self, request: LlmRequest, blocks: Sequence[int]) -> None:
        source, self._asked = self._asked, None
        if source is None:
            raise RuntimeError(f"no connector was asked for {request.request_id}'s KV")
        if len(self._source) >= PRUNE_AT:
            self._prune()
        self._source[request.request_id] = (source, request)
        source.after_allocate(request, blocks)

    def _prune(self) -> None:
        for rid in [rid for rid, (_, r) in self._source.items() if r.is_finished]:
            del self._source[rid]

    def finish_load(self, request: LlmRequest) -> None:
        self._source.pop(request.request_id)[0].finish_load(request)

    def request_finished(self, request: LlmRequest) -> bool:
        self._source.pop(request.request_id, None)
        held = [c.request_finished(request) for c in self.connectors]
        return any(held)

    def release(self, request_id: str) -> None:
        for c in self.connectors:
            c.release(request_id)

    # ---- model side -----------------------------------------------------------------------
    def start_load_kv(self, scheduled: Sequence[ScheduledRequest]) -> None:
        # a scheduled request's load is this step's (one landed from outside was finished
        # before it could be scheduled): nothing of it is left to route
        for s in scheduled:
            self._source.pop(s.request.request_id, None)
        for c in self.connectors:
            c.start_load_kv(scheduled)

    def layer_hook(self, scheduled: Sequence[ScheduledRequest]) -> LayerHook | None:
        hooks = [h for c in self.connectors if (h := c.layer_hook(scheduled)) is not None]
        if len(hooks) <= 1:
            return hooks[0] if hooks else None

        def each(layer: int) -> None:
            for h in hooks:
                h(layer)

        return each

    def wait_for_save(self) -> None:
        for c in self.connectors:
            c.wait_for_save()

    def offload_blocks(self) -> int:
        return sum(c.offload_blocks() for c in self.connectors)

    def shutdown(self) -> None:
        for c in self.connectors:
            c.shutdown()
