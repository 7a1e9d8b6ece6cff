"""Where KV comes from and goes to beyond this engine's own pool: the KV connector.

A connector is how a prefill node's pushes leave the engine and how a decode node's reserved
blocks are filled from outside; a KV offload tier (host memory, disk) plugs in at the same
points. It has two sides, as vLLM's `KVConnectorBase_V1`:

- **scheduler side** (bookkeeping on the engine thread: no torch, no I/O): how many of a
  request's tokens an external source will supply beyond the local prefix-cache hit
  (`external_tokens`), what to do once blocks are reserved for them (`after_allocate`), when
  they have landed (`finish_load`), and whether a finished request's blocks must stay held
  while its KV is still being saved elsewhere (`request_finished`, then `release`).
- **model side** (inside a step, around the forward): start loading what the step reads
  (`start_load_kv`), save each layer as it is written (`layer_hook`), and wait for saves the
  step's blocks depend on (`wait_for_save`).

The engine core and the roles know this interface only; the P/D implementations live beside it
(`kv_push.py` on a prefill node, `kv_landing.py` on a decode node) and never import UCX: the
node hands them what moves bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from shared.engine.connector.scheduler_side import KvConnectorScheduler
from shared.engine.requests.request import LlmRequest
from shared.engine.scheduling.scheduler import ScheduledRequest

if TYPE_CHECKING:  # the pool is only handed through here
    import torch

# the model's per-layer hook (shared/model/step_context.py), spelled here so that the interface
# imports no torch
LayerHook = Callable[[int], None]


class KvConnector(KvConnectorScheduler, Protocol):
    def register_kv_pool(self, pool: torch.Tensor) -> None:
        """The engine's paged pool, once allocated: where loads land and saves read from."""
        ...

    # ---- model side -----------------------------------------------------------------------
    def start_load_kv(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Before the step's forward: what it reads from outside is in the pool on return."""
        ...

    def layer_hook(self, scheduled: Sequence[ScheduledRequest]) -> LayerHook | None:
        """What the model calls after each layer's K/V of this step are written, if anything
        (scheduled requests' counters are not yet advanced)."""
        ...

    def wait_for_save(self) -> None:
        """After the step's forward: return once nothing still reads blocks the next step may
        overwrite."""
        ...

    def offload_blocks(self) -> int:
        """Blocks of this engine's KV the connector keeps below the pool (offload tiers), once
        the pool is registered: a prefix there is loaded back rather than recomputed."""
        ...

    def shutdown(self) -> None:
        """The engine stops (every request already released, the pool's bytes still valid):
        keep what should outlive this process, within the connector's own time limit."""
        ...


class NoKvConnector:
    """Nothing comes from or goes anywhere but this pool."""

    def register_kv_pool(self, pool: torch.Tensor) -> None:
        pass

    def external_tokens(self, request: LlmRequest, local_tokens: int) -> int:
        return 0

    def after_allocate(self, request: LlmRequest, blocks: Sequence[int]) -> None:
        raise RuntimeError("no external source was asked for this request's KV")

    def finish_load(self, request: LlmRequest) -> None:
        raise RuntimeError("no external source was asked for this request's KV")

    def request_finished(self, request: LlmRequest) -> bool:
        return False

    def release(self, request_id: str) -> None:
        pass

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
