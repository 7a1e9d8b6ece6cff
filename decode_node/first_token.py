"""The prefill node's first token, released to the client the moment the `Prefill` RPC returns.

When the RPC returns every KV byte has landed, so the token is final; but the engine takes it
(the `KvLanded` command) only between two of its steps, up to one decode step later on a busy
node (the shared-prefix benchmark measured ~7 ms steps beside a 40 ms TTFT). The delta the
engine computes for a first token is a pure function of the prompt, the sampling parameters and
the token (detokenized text, stop strings, EOS, max_tokens), so the event loop computes the same
delta with a throwaway `OutputProcessor` and streams it at once; the engine's copy, when it
arrives, is checked against it and dropped, and the engine's later deltas continue from the same
text offset. n > 1 keeps the engine's path: its other completions are forked there.
"""

from __future__ import annotations

import asyncio
import logging

from decode_node.grammar_check import check_first_tokens
from decode_node.prefill_answer import FirstTokens
from decode_node.stream import Stream
from shared.engine.commands import KvLanded
from shared.engine.info import EngineInfo
from shared.engine.requests.output import OutputProcessor, TokenDelta
from shared.engine.requests.request import LlmRequest
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.thread import EngineThread
from shared.serving.grpc_server import GenerateError
from shared.serving.status import Status

log = logging.getLogger(__name__)


def early_first_delta(
    info: EngineInfo,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    first: FirstTokens,
) -> TokenDelta | None:
    """The delta the engine will emit for the prefill node's first token (None: n > 1)."""
    token, logprobs, prompt_logprobs, choices, _ = first
    if params.n != 1 or choices:
        return None
    request = LlmRequest(request_id, prompt, params)
    if prompt_logprobs is not None:
        request.prompt_logprobs = prompt_logprobs
    # the engine's immutable tokenizer and EOS ids; the processor's state is its own
    processor = OutputProcessor(info.tokenizer, info.eos_token_ids)
    processor.add(request)
    return processor.process(request, token, logprobs)


def drop_twin(early: TokenDelta, engine_deltas: list[TokenDelta]) -> list[TokenDelta]:
    """The engine's deltas for the first token, without the one already streamed as `early`."""
    twin, rest = engine_deltas[0], engine_deltas[1:]
    if twin != early:  # every field: tokens, text, finish, logprobs, completion index
        # cannot happen while OutputProcessor is a pure function of its inputs; say so loudly
        log.error("%s: first delta streamed early %r != engine's %r", early.request_id, early, twin)
    return rest


async def release_first(
    thread: EngineThread,
    stream: Stream,
    prompt: list[int],
    params: SamplingParams,
    first: FirstTokens,
) -> list[TokenDelta]:
    """Hand the landed request to the engine; return the first deltas to stream now: the early
    one (the engine's copy is awaited later, by `engine_took_first`), or, for n > 1, the
    engine's own once it has taken them."""
    check_first_tokens(thread.info, prompt, params, first)
    if first[4] != stream.mrope_delta:
        raise GenerateError(
            Status.INTERNAL,
            f"the prefill node's KV headers carry mRoPE delta {first[4]} for the prompt's "
            f"images, this node lays them out with {stream.mrope_delta}; refusing its KV (do "
            "both serve the same model and image settings?)",
        )
    rid = stream.request_id
    completing = thread.submit(KvLanded(rid, *first))
    early = early_first_delta(thread.info, rid, prompt, params, first)
    if early is None:
        return await asyncio.wrap_future(completing)
    stream.completing, stream.early_first = completing, early
    return [early]


async def engine_took_first(stream: Stream) -> list[TokenDelta]:
    """The engine's deltas for the first token streamed early, less that one; from here the
    engine's step deltas follow on the stream's queue."""
    assert stream.completing is not None and stream.early_first is not None
    completing, stream.completing = stream.completing, None
    return drop_twin(stream.early_first, await asyncio.wrap_future(completing))
