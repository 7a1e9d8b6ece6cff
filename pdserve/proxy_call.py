"""One client call as the proxy forwards it (pdserve/proxy.py): what it carries from one
backend to the next, and what is never forwarded."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from grpc import aio

from pdserve.prompt_key import PromptKey
from pdserve.replay import ReplayableRequests
from pdserve.stream_resume import GenerateLedger

# Set by gRPC itself on every hop: forwarding them would duplicate or contradict the new hop's.
HOP_HEADERS = frozenset(
    {
        "user-agent",
        "te",
        "content-type",
        "host",
        "grpc-timeout",
        "grpc-encoding",
        "grpc-accept-encoding",
        "grpc-status",
        "grpc-message",
    }
)


def forwardable(metadata: Sequence[tuple[str, str | bytes]] | None) -> list[tuple[str, object]]:
    return [(k, v) for k, v in (metadata or ()) if k not in HOP_HEADERS and not k.startswith(":")]


@dataclass
class ProxiedCall:
    """One client call as the proxy forwards it, over however many backends it takes."""

    method: str
    requests: ReplayableRequests
    metadata: list[tuple[str, object]]
    deadline: float | None
    key: PromptKey | None = None
    ledger: GenerateLedger | None = None  # a Generate call's request and what was sent
    tried: set[str] = field(default_factory=set)
    answered: bool = False  # some backend answered: no plain retry any more
    done: bool = False
    resume_request: bytes | None = None  # what the next backend is asked: the rest of a stream
    last_error: str = "no decode node is known"


async def send_one(rpc: aio.StreamStreamCall, request: bytes) -> None:
    """A resumed call's one request message, then half-close."""
    with contextlib.suppress(Exception):  # the call ended (error or cancel)
        await rpc.write(request)
        await rpc.done_writing()
