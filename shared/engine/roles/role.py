"""What an engine is for: the `Role` a node gives its engine, and the parts a role works with.

A prefill node's engine ends a request with its first token and keeps its blocks pinned for the
push (`PrefillRole`); a decode node's generates every token, admits requests whose KV a prefill
node pushes, and places each prompt here or there (`DecodeRole`). A role is an object built over
the engine's parts; it never sees the `EngineCore` that holds them, and the core never names a
role: it takes the `RoleSettings` its node gives it and asks them for the connector and the
scheduling rule the role needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shared.engine.config import EngineConfig
from shared.engine.connector.base import KvConnector
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import LlmRequest
from shared.engine.requests.request_table import RequestTable
from shared.engine.resources.resource_manager import KVCacheManager
from shared.engine.runtime.model_runner import ModelRunner
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.engine.scheduling.scheduler import Hold, Scheduler

# a role's commands: command type -> what runs it on the engine thread (shared/engine/commands.py)
Handlers = dict[type, Callable[[Any], Any]]
# what a role tells its node between commands (e.g. an admission grant), posted to the node's loop
Emit = Callable[[object], None]


@dataclass
class EngineParts:
    """The engine's state a role works with (engine thread only)."""

    config: EngineConfig
    requests: RequestTable
    kv_manager: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    connector: KvConnector  # where KV comes from and goes to beyond the pool
    num_steps: int = 0  # forward steps run so far


class Role(Protocol):
    # a request ends with its first token (its prompt's KV is what the node produces)
    context_only: bool

    def accept_tokens(
        self,
        request: LlmRequest,
        tokens: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None],
    ) -> list[TokenDelta]:
        """A step produced `tokens` for `request` (its context complete), in order, with one
        logprobs entry each: the deltas to stream. A step carries one token per request today;
        a speculative step carries the accepted draft tokens and the bonus token."""
        ...

    def end_with_error(
        self, request: LlmRequest, token: int, logprobs: TokenLogprobs | None, reason: str
    ) -> list[TokenDelta]:
        """The step sampled `token` for `request`, but its grammar cannot go on (`reason`, for
        the client): the deltas that end the request with that error."""
        ...

    def after_step(self) -> None:
        """After every step and command: the only moments blocks free up."""
        ...

    def handlers(self) -> Handlers:
        """The commands only this role runs."""
        ...

    def bind(self, emit: Emit) -> None:
        """Where the role's events go (the engine thread posts them to the node)."""
        ...


class RoleSettings(Protocol):
    """How a node asks for a role; the engine builds it over its parts."""

    context_only: bool

    def connector(self, kv: KVCacheManager) -> KvConnector:
        """The KV connector this role moves KV through (shared/engine/connector/)."""
        ...

    def hold(self) -> Hold | None:
        """The scheduler's rule for keeping a fresh prompt out of a non-empty batch, if any."""
        ...

    def drafting(self) -> RoleSettings:
        """The settings of an engine that drafts for this one (a speculative draft model): it
        decodes what it is given, with no KV from outside and no tiers of its own."""
        ...

    def build(self, parts: EngineParts) -> Role: ...
