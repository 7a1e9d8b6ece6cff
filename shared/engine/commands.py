"""The engine's door: every piece of work a node hands its engine is one of these commands,
run on the engine thread between two steps (`EngineThread.call`). Their fields are what crosses
the boundary; the engine's state never does. Outputs come back as the command's result, or as
token deltas and admission grants on the thread's callbacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.engine.requests.multimodal import PromptImage
from shared.engine.resources.block_manager import BlockHash
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.lora_adapter import LoraAdapter


@dataclass(frozen=True)
class AddRequest:
    """Schedule a prompt on this engine (QUEUED until its blocks are free). Result: the
    request's record (read its timings only after its deltas arrive)."""

    prompt: Sequence[int]
    params: SamplingParams
    request_id: str = ""
    images: Sequence[PromptImage] = ()  # the prompt's, in placeholder order


@dataclass(frozen=True)
class Abort:
    """End the request (and its n > 1 completions) wherever it is; nothing if it has ended."""

    request_id: str


@dataclass(frozen=True)
class WarmUp:
    """Run the start-up forwards on the idle engine (shared/engine/runtime/warmup.py)."""


@dataclass(frozen=True)
class LoadLora:
    """Put an adapter (read and checked off the engine thread) in a free slot, between steps."""

    adapter: LoraAdapter


@dataclass(frozen=True)
class UnloadLora:
    """Free an adapter's slot; refused while a request of it is live."""

    name: str


@dataclass(frozen=True)
class Shutdown:
    """Abort what is left through the normal release path; result: whether every seat and
    block was back in its pool before anything was force-freed."""


# ---- a prefill node's engine -----------------------------------------------------------------
@dataclass(frozen=True)
class ContextPushed:
    """The push of the request's KV ended (ok or not), or the node gave it up: release it."""

    request_id: str
    ok: bool


# ---- a decode node's engine ------------------------------------------------------------------
@dataclass(frozen=True)
class PlacePrompt:
    """Prefill the prompt here, or queue it for a prefill node's push: the engine decides from
    its own load (shared/engine/scheduling/placement.py). `fallback`: here whatever the length (a
    colocated
    node, or no prefill node could serve it). Result: the request's record when it went local,
    else None (its blocks are granted later, on the thread's admission callback)."""

    prompt: Sequence[int]
    params: SamplingParams
    request_id: str
    deadline: float | None = None  # time.monotonic() by which it must be admitted
    hashes: Sequence[BlockHash] = ()  # the prompt's full-block hashes, computed once
    fallback: bool = False
    # the prompt's images: prefilled here (prefill nodes take text prompts only)
    images: Sequence[PromptImage] = ()


@dataclass(frozen=True)
class KvLanded:
    """Every KV byte of the request landed, with the first tokens the prefill node sampled.
    Result: the first tokens' deltas (the request's own, then its n > 1 forks')."""

    request_id: str
    first_token: int
    first_logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    choices: Sequence[tuple[int, TokenLogprobs | None]] = field(default=())
    # mRoPE: position minus index after the prompt, as the prefill node laid its images out;
    # written at the request's seat (it must agree with the request's own layout)
    mrope_delta: int = 0


@dataclass(frozen=True)
class TransferFailed:
    """The transfer for this request failed: it ends DISAGG_TRANS_ERROR, its blocks back."""

    request_id: str


@dataclass(frozen=True)
class Drain:
    """The node is shutting down: end every queued request and queue no more; result: their
    ids."""


Command = (
    AddRequest
    | Abort
    | WarmUp
    | LoadLora
    | UnloadLora
    | Shutdown
    | ContextPushed
    | PlacePrompt
    | KvLanded
    | TransferFailed
    | Drain
)
