"""One Generate request as the decode node's request path tracks it (event loop side)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.engine.requests.multimodal import PromptImage
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import FinishReason
from shared.engine.scheduling.transfer_admission import TransferGrant

if TYPE_CHECKING:
    from decode_node.peers import PrefillPeer
    from shared.engine.requests.request import LlmRequest


class PrefillFailed(Exception):
    """The prefill node could not serve this attempt; another node (or this one) may.
    `node_at_fault` False: this node ended the attempt (its KV listener reset), the same
    prefill node may be asked again."""

    def __init__(self, message: str, node_at_fault: bool = True) -> None:
        super().__init__(message)
        self.node_at_fault = node_at_fault


@dataclass
class Stream:
    request_id: str
    prompt_len: int
    queue: asyncio.Queue[TokenDelta] = field(default_factory=asyncio.Queue)
    transfer_id: int | None = None
    peer: PrefillPeer | None = None
    prefill_id: str = ""  # the request id of the current Prefill attempt (remote_prefill)
    prefill_done: bool = False
    images: tuple[PromptImage, ...] = ()  # the prompt's, for the Prefill call
    mrope_delta: int = 0  # what this node makes of the prompt's images (mRoPE models)
    admitted_at: float = field(default_factory=time.monotonic)
    # set by the engine thread's admission callback: a grant, None (deadline passed in the
    # queue) or an exception (drained at shutdown)
    admission: asyncio.Future[TransferGrant | None] | None = None
    admission_wait: float = 0.0  # seconds QUEUED on this node
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    kv_transfer_seconds: float = 0.0
    first_token_at: float | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    deadline: float | None = None  # monotonic; None: the client set none
    n: int = 1  # completions; the stream ends when each has finished
    finished: dict[int, FinishReason] = field(default_factory=dict)  # completion -> why it ended
    tokens_by_index: dict[int, int] = field(default_factory=dict)
    failed: bool = False  # ended by an error: the engine records DISAGG_TRANS_ERROR
    # prefilled by this node's own engine (QUEUED -> CONTEXT_INIT), not by a prefill node
    local: LlmRequest | None = None
    # remote prefill: the engine's complete_transfer_all in flight, and the first token's
    # delta already streamed from the Prefill response (decode_node/first_token.py)
    completing: Future[list[TokenDelta]] | None = None
    early_first: TokenDelta | None = None

    def account(self, delta: TokenDelta) -> None:
        """Count a delta of completion `delta.index` before it is streamed."""
        self.completion_tokens += len(delta.token_ids)
        self.tokens_by_index[delta.index] = self.tokens_by_index.get(delta.index, 0) + len(
            delta.token_ids
        )
        if delta.finish_reason is not None:
            self.finished[delta.index] = delta.finish_reason

    def deadline_passed(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline
