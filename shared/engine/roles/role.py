"""What an engine is for: the `Role` a node gives its engine, and the parts a role works with.

A prefill node's engine ends a request with its first token and keeps its blocks pinned for the
push (`PrefillRole`); a decode node's generates every token, admits requests whose KV a prefill
node pushes, and places each prompt here or there (`DecodeRole`). A role is an object built over
the engine's parts; it never sees the `EngineCore` that holds them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shared.engine.config import EngineConfig
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import LlmRequest
from shared.engine.requests.request_table import RequestTable
from shared.engine.resources.resource_manager import KVCacheManager
from shared.engine.runtime.model_runner import LayerHook, ModelRunner
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.engine.scheduling.scheduler import ScheduledRequest, Scheduler

# a role's commands: command type -> what runs it on the engine thread (shared/engine/commands.py)
Handlers = dict[type, Callable[[Any], Any]]


@dataclass
class EngineParts:
    """The engine's state a role works with (engine thread only)."""

    config: EngineConfig
    requests: RequestTable
    kv_manager: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    num_steps: int = 0  # forward steps run so far


class Role(Protocol):
    # a request ends with its first token (its prompt's KV is what the node produces)
    context_only: bool

    def accept_token(
        self, request: LlmRequest, token: int, logprobs: TokenLogprobs | None
    ) -> list[TokenDelta]:
        """A token was sampled for `request` (its context is complete): the deltas to stream."""
        ...

    def after_step(self) -> None:
        """After every step and command: the only moments blocks free up."""
        ...

    def layer_hook(self, scheduled: Sequence[ScheduledRequest]) -> LayerHook | None:
        """What the model calls after each layer's K/V of this step are written, if anything."""
        ...

    def handlers(self) -> Handlers:
        """The commands only this role runs."""
        ...


class RoleSettings(Protocol):
    """How a node asks for a role; the engine builds it over its parts."""

    context_only: bool

    def build(self, parts: EngineParts) -> Role: ...
