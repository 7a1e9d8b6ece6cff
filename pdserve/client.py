"""Async client for the public pdserve.v1.Generation service.

Used by the `pdserve generate` CLI (which prints text as it streams) and by tests and benchmarks.
RPC failures surface as `grpc.aio.AioRpcError`; its `.code()` follows the error semantics
documented in proto/pdserve/v1/generation.proto (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...).

    async for chunk in generate_stream("localhost:50051", "Hello", max_tokens=32):
        print(chunk.text, end="", flush=True)

    result = await generate("localhost:50051", [1, 15043], max_tokens=8, seed=7)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from grpc import aio

from proto.pdserve.v1 import generation_pb2, generation_pb2_grpc, prefill_pb2_grpc

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_MAX_TOKENS",
    "GenerationResult",
    "IncompleteStreamError",
    "build_generate_request",
    "channel_options",
    "create_channel",
    "finish_reason_name",
    "generate",
    "generate_stream",
    "get_model_info",
]

# Same default as shared.engine.sampling_params.SamplingParams: omitting it behaves like the server.
DEFAULT_MAX_TOKENS = 16
# Prompts go over the wire as token lists or text; 64 MiB leaves room for very long contexts
# without letting a runaway message exhaust memory.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class IncompleteStreamError(RuntimeError):
    """The server closed a Generate stream with OK status but without a final message."""


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC channel options pdserve uses for every channel (clients and node-to-node)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def create_channel(
    target: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> aio.Channel:
    """An insecure grpc.aio channel to `target` ("host:port"); the caller closes it."""
    return aio.insecure_channel(target, options=channel_options(max_message_bytes))


@contextlib.asynccontextmanager
async def _channel_scope(target: str, channel: aio.Channel | None) -> AsyncIterator[aio.Channel]:
    """Use the caller's channel as is, or open (and finally close) a private one."""
    if channel is not None:
        yield channel
        return
    owned = create_channel(target)
    try:
        yield owned
    finally:
        await owned.close()


def finish_reason_name(reason: int) -> str:
    """FINISH_REASON_STOP -> "stop"; the form GenerationResult.finish_reason uses."""
    return generation_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def build_generate_request(
    prompt: str | Sequence[int],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: str | Sequence[str] = (),
    ignore_eos: bool = False,
    request_id: str = "",
) -> generation_pb2.GenerateRequest:
    """The GenerateRequest for these arguments (validation is the server's job)."""
    # A lone string would otherwise be split into one stop string per character.
    stops = [stop] if isinstance(stop, str) else list(stop)
    sampling = generation_pb2.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,  # None leaves the optional field unset: the server draws a seed
        stop=stops,
        ignore_eos=ignore_eos,
    )
    if isinstance(prompt, str):
        return generation_pb2.GenerateRequest(request_id=request_id, text=prompt, sampling=sampling)
    return generation_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=generation_pb2.TokenIds(ids=[int(t) for t in prompt]),
        sampling=sampling,
    )


async def generate_stream(
    target: str,
    prompt: str | Sequence[int],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: str | Sequence[str] = (),
    ignore_eos: bool = False,
    request_id: str = "",
    timeout: float | None = None,
    channel: aio.Channel | None = None,
) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """Stream GenerateResponse messages as the server produces them.

    `timeout` is the gRPC deadline for the whole stream, in seconds. Pass `channel` to reuse a
    connection (then `target` is ignored); otherwise a channel is opened and closed per call.
    Stopping early cancels the RPC, which aborts the request server-side; to make that happen
    promptly rather than at garbage collection, iterate inside `contextlib.aclosing(...)`.
    """
    request = build_generate_request(
        prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop,
        ignore_eos=ignore_eos,
        request_id=request_id,
    )
    async with _channel_scope(target, channel) as ch:
        call = generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=timeout)
        try:
            async for response in call:
                yield response
        finally:
            # No-op after normal completion; frees the server's KV blocks when the caller bails.
            call.cancel()


@dataclass
class GenerationResult:
    """A whole Generate stream, collected."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # "length", "stop" or "aborted" (see finish_reason_name).
    finish_reason: str = "unspecified"
    usage: generation_pb2.Usage = field(default_factory=generation_pb2.Usage)
    timing: generation_pb2.Timing = field(default_factory=generation_pb2.Timing)


async def generate(
    target: str,
    prompt: str | Sequence[int],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: str | Sequence[str] = (),
    ignore_eos: bool = False,
    request_id: str = "",
    timeout: float | None = None,
    channel: aio.Channel | None = None,
) -> GenerationResult:
    """Run one request to completion and collect its stream (same arguments as generate_stream).

    Raises grpc.aio.AioRpcError on RPC failure, IncompleteStreamError if the stream ended
    without a finish reason.
    """
    result = GenerationResult(request_id=request_id)
    text_parts: list[str] = []
    stream = generate_stream(
        target,
        prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop,
        ignore_eos=ignore_eos,
        request_id=request_id,
        timeout=timeout,
        channel=channel,
    )
    finished = False
    async with contextlib.aclosing(stream):
        async for response in stream:
            result.request_id = response.request_id or result.request_id
            result.token_ids.extend(response.token_ids)
            text_parts.append(response.text)
            if response.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
                finished = True
                result.finish_reason = finish_reason_name(response.finish_reason)
                result.usage.CopyFrom(response.usage)
                result.timing.CopyFrom(response.timing)
    if not finished:
        raise IncompleteStreamError(
            f"Generate stream for request {result.request_id!r} ended without a finish reason "
            f"after {len(result.token_ids)} tokens"
        )
    result.text = "".join(text_parts)
    return result


async def get_model_info(
    target: str,
    *,
    service: Literal["generation", "prefill"] = "generation",
    timeout: float | None = 10.0,
    channel: aio.Channel | None = None,
) -> generation_pb2.ModelInfo:
    """ModelInfo from a decode/colocated node (service="generation") or a prefill node."""
    async with _channel_scope(target, channel) as ch:
        stub: generation_pb2_grpc.GenerationStub | prefill_pb2_grpc.PrefillStub
        if service == "prefill":
            stub = prefill_pb2_grpc.PrefillStub(ch)
        else:
            stub = generation_pb2_grpc.GenerationStub(ch)
        return await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout)
