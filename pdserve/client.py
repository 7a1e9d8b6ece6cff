"""Async client for the public pdserve.v1.Generation service.

Used by the `pdserve generate` CLI (which prints text as it streams) and by tests and benchmarks.
RPC failures surface as `grpc.aio.AioRpcError`; its `.code()` follows the error semantics
documented in proto/pdserve/v1/generation.proto (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...).

    async for chunk in generate_stream("localhost:50051", "Hello", SamplingParams(max_tokens=32)):
        print(chunk.text, end="", flush=True)

    result = await generate("localhost:50051", [1, 15043], SamplingParams(max_tokens=8, seed=7))
    result = await generate("localhost:50051", "Hi", max_tokens=8)  # the fields as keywords
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from grpc import aio

from proto.pdserve.v1 import generation_pb2, generation_pb2_grpc, prefill_pb2_grpc
from shared.engine.sampling.sampling_params import SamplingParams
from shared.serving.limits import GRPC_CHANNEL_OPTIONS
from shared.serving.wire import sampling_to_proto

__all__ = [
    "GenerationResult",
    "IncompleteStreamError",
    "SamplingParams",
    "build_generate_request",
    "create_channel",
    "finish_reason_name",
    "generate",
    "generate_stream",
    "get_model_info",
]


class IncompleteStreamError(RuntimeError):
    """The server closed a Generate stream with OK status but without a final message."""


def create_channel(target: str) -> aio.Channel:
    """An insecure grpc.aio channel to `target` ("host:port") with pdserve's message limits
    (shared/serving/limits.py); the caller closes it."""
    return aio.insecure_channel(target, options=GRPC_CHANNEL_OPTIONS)


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


def _params(params: SamplingParams | None, fields: dict[str, Any]) -> SamplingParams:
    """`params`, or one built from keyword fields (`generate(t, p, max_tokens=8)`), not both."""
    if params is not None:
        if fields:
            raise TypeError(f"pass either a SamplingParams or its fields, not both: {fields}")
        return params
    if isinstance(fields.get("stop"), str):  # a lone string, not one stop per character
        fields["stop"] = (fields["stop"],)
    elif "stop" in fields:
        fields["stop"] = tuple(fields["stop"])
    return SamplingParams(**fields)


def build_generate_request(
    prompt: str | Sequence[int], params: SamplingParams, request_id: str = ""
) -> generation_pb2.GenerateRequest:
    """The GenerateRequest for these arguments (validation is the server's job)."""
    sampling = sampling_to_proto(params)
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
    params: SamplingParams | None = None,
    *,
    request_id: str = "",
    timeout: float | None = None,
    channel: aio.Channel | None = None,
    **sampling: Any,
) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """Stream GenerateResponse messages as the server produces them.

    `params` (or, for brevity, SamplingParams' fields as keywords: `max_tokens=8, seed=7`) say
    how to sample. `timeout` is the gRPC deadline for the whole stream, in seconds. Pass
    `channel` to reuse a connection (then `target` is ignored); otherwise a channel is opened
    and closed per call. Stopping early cancels the RPC, which aborts the request server-side;
    to make that happen promptly rather than at garbage collection, iterate inside
    `contextlib.aclosing(...)`.
    """
    request = build_generate_request(prompt, _params(params, sampling), request_id)
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
    params: SamplingParams | None = None,
    *,
    request_id: str = "",
    timeout: float | None = None,
    channel: aio.Channel | None = None,
    **sampling: Any,
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
        _params(params, sampling),
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
