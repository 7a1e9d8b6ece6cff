"""The wire's sampling fields <-> SamplingParams, and the one validation of a request's
parameters that every public surface (gRPC, HTTP) runs before anything is allocated.

The only place outside the proto that spells the sampling fields. Validation failures raise
WireError (a ValueError) whose message names the field: gRPC maps it to INVALID_ARGUMENT, HTTP
to a 400 error object.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError

from proto.pdserve.v1 import generation_pb2
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.sampling.structured_output import KINDS, StructuredOutput
from shared.engine.scheduling.service_level import ServiceLevel
from shared.serving.limits import MAX_REQUEST_ID_CHARS, MAX_SEED

__all__ = [
    "WireError",
    "add_servicer",
    "check_request_id",
    "check_sampling",
    "continue_answer",
    "generate_params_from_proto",
    "logprob_from_proto",
    "logprob_to_proto",
    "prompt_logprobs_from_proto",
    "prompt_logprobs_to_proto",
    "sampling_from_proto",
    "sampling_to_proto",
    "structured_from_proto",
    "structured_to_proto",
    "validate_request",
]


class WireError(ValueError):
    """A request field out of bounds; `field` is its dotted name (e.g. "sampling.top_k")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def sampling_from_proto(
    s: generation_pb2.SamplingParams, seed: int | None = None
) -> SamplingParams:
    """The wire's sampling fields (top_p 0 = off); `seed` overrides the message's own."""
    if seed is None and s.HasField("seed"):
        seed = s.seed
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=1.0 if s.top_p == 0.0 else s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        seed=seed,
        stop=tuple(s.stop),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        repetition_penalty=s.repetition_penalty or 1.0,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias=dict(s.logit_bias),
        min_tokens=s.min_tokens,
        stop_token_ids=tuple(s.stop_token_ids),
        n=s.n or 1,
        include_stop_str_in_output=s.include_stop_str_in_output,
        structured=structured_from_proto(s.structured) if s.HasField("structured") else None,
        output_index_offset=s.output_index_offset,
        continued_tokens=s.continued_tokens,
        lora_adapter=s.lora_adapter or None,
    )


# StructuredOutput.kind <-> the wire's StructuredKind, in KINDS' order (0 is unspecified)
_KIND_VALUES = {kind: i + 1 for i, kind in enumerate(KINDS)}


def structured_from_proto(msg: generation_pb2.StructuredOutput) -> StructuredOutput:
    """An unset or unknown kind passes through as such: validation names it (INVALID_ARGUMENT)."""
    kind = KINDS[msg.kind - 1] if 1 <= msg.kind <= len(KINDS) else f"kind {msg.kind}"
    return StructuredOutput(kind, msg.spec)  # type: ignore[arg-type]


def structured_to_proto(structured: StructuredOutput) -> generation_pb2.StructuredOutput:
    return generation_pb2.StructuredOutput(
        kind=_KIND_VALUES[structured.kind],  # type: ignore[arg-type]
        spec=structured.spec,
    )


def generate_params_from_proto(request: generation_pb2.GenerateRequest) -> SamplingParams:
    """A GenerateRequest's sampling fields with its service level (priority, SLO targets)."""
    service = ServiceLevel(
        priority=request.priority,
        ttft_slo_ms=request.ttft_slo_ms if request.HasField("ttft_slo_ms") else None,
        itl_slo_ms=request.itl_slo_ms if request.HasField("itl_slo_ms") else None,
    )
    return replace(sampling_from_proto(request.sampling), service=service)


def continue_answer(
    request: generation_pb2.GenerateRequest, prompt: list[int], params: SamplingParams
) -> tuple[list[int], SamplingParams]:
    """The prompt and sampling of a request that continues an answer (its `continuation`: the
    output tokens some earlier call already streamed): those tokens follow the prompt, seeded
    draws go on at their output index, max_tokens and min_tokens count what is left."""
    if not request.HasField("continuation"):
        return prompt, params
    try:
        return params.continued(prompt, list(request.continuation.ids))
    except ValueError as e:
        raise WireError("continuation", str(e)) from None


def sampling_to_proto(params: SamplingParams) -> generation_pb2.SamplingParams:
    msg = generation_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=params.logit_bias,
        min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids),
        n=params.n,
        include_stop_str_in_output=params.include_stop_str_in_output,
        output_index_offset=params.output_index_offset,
        continued_tokens=params.continued_tokens,
        lora_adapter=params.lora_adapter or "",
    )
    if params.seed is not None:  # unset: the server draws one
        msg.seed = params.seed
    if params.structured is not None:
        msg.structured.CopyFrom(structured_to_proto(params.structured))
    return msg


def logprob_to_proto(lp: TokenLogprobs) -> generation_pb2.TokenLogprob:
    return generation_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_logprobs=[generation_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprob_from_proto(msg: generation_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(
        msg.token_id, msg.logprob, [(t.token_id, t.logprob) for t in msg.top_logprobs]
    )


def prompt_logprobs_to_proto(
    entries: list[TokenLogprobs | None],
) -> list[generation_pb2.TokenLogprob]:
    """Positions 1.. of the prompt (position 0 has no logprob)."""
    return [logprob_to_proto(lp) for lp in entries[1:] if lp is not None]


def prompt_logprobs_from_proto(
    msgs: Sequence[generation_pb2.TokenLogprob],
) -> list[TokenLogprobs | None]:
    return [None, *(logprob_from_proto(m) for m in msgs)]


def check_request_id(request_id: str) -> None:
    """Empty (the server assigns one) or at most MAX_REQUEST_ID_CHARS printable ASCII chars."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise WireError(
            "request_id",
            f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} allowed",
        )
    bad = next((c for c in request_id if not " " <= c <= "~"), None)
    if bad is not None:
        raise WireError(
            "request_id",
            f"request_id may hold only printable ASCII characters, found {bad!r}",
        )


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    """SamplingParams.validate (finite floats, ranges, stop strings) plus what needs the model."""
    try:
        params.validate()
    except ValueError as e:
        field = str(e).split(" ", 1)[0] if str(e).startswith("sampling.") else "sampling"
        raise WireError(field, str(e)) from None
    if params.top_k > vocab_size:
        raise WireError(
            "sampling.top_k",
            f"sampling.top_k must be <= the vocabulary size {vocab_size}, got {params.top_k}",
        )
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise WireError("sampling.seed", f"sampling.seed must fit in uint64, got {params.seed}")


def validate_request(request_id: str, params: SamplingParams, vocab_size: int) -> None:
    """Everything about a request's id and parameters that can be judged without the prompt;
    the engine's validate_request then checks the prompt against the model and the pool."""
    check_request_id(request_id)
    check_sampling(params, vocab_size)


_UNPARSABLE = object()


def add_servicer(server: grpc.aio.Server, servicer: object, service: ServiceDescriptor) -> None:
    """Register `servicer`'s async methods for `service`, like the generated
    add_*Servicer_to_server, except that a request whose bytes do not parse (truncated, bad
    varints, invalid UTF-8 in a string field) is answered INVALID_ARGUMENT instead of gRPC's
    INTERNAL: it is the caller's fault, and INTERNAL would read as the node's."""
    handlers = {m.name: _handler(getattr(servicer, m.name), m) for m in service.methods}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )


def _handler(behavior: Callable[..., Any], method: MethodDescriptor) -> grpc.RpcMethodHandler:
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    what = f"request is not a valid {method.input_type.full_name} message"

    def parse(data: bytes) -> object:
        try:
            return request_cls.FromString(data)
        except DecodeError:
            return _UNPARSABLE

    if method.server_streaming:

        async def streaming(request: object, context: grpc.aio.ServicerContext) -> Any:
            if request is _UNPARSABLE:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, what)
            async for response in behavior(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            streaming, parse, response_cls.SerializeToString
        )

    async def unary(request: object, context: grpc.aio.ServicerContext) -> Any:
        if request is _UNPARSABLE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, what)
        return await behavior(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, parse, response_cls.SerializeToString)
