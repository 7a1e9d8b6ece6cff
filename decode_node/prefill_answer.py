"""What a prefill node's answer gives the engine: the first token of each completion, with the
logprobs asked for, and the prompt's mRoPE delta its KV headers carried."""

from __future__ import annotations

from proto.pdserve.v1 import prefill_pb2
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.engine.sampling.sampling_params import SamplingParams
from shared.serving.grpc_server import GenerateError
from shared.serving.status import Status
from shared.serving.wire import logprob_from_proto, prompt_logprobs_from_proto

# the first token of each completion as the engine's KvLanded takes it, and the prompt's mRoPE
# delta as the prefill node laid its images out
FirstTokens = tuple[
    int,
    TokenLogprobs | None,
    list[TokenLogprobs | None] | None,
    list[tuple[int, TokenLogprobs | None]],
    int,
]


def first_tokens(
    response: prefill_pb2.PrefillResponse, params: SamplingParams, mrope_delta: int
) -> FirstTokens:
    """The prefill node's first token with its logprobs and the prompt's (when asked), the
    other completions' first tokens (n > 1), and the mRoPE delta its KV headers carried."""
    first = None
    if params.logprobs is not None and response.HasField("first_token_logprobs"):
        first = logprob_from_proto(response.first_token_logprobs)
    prompt = None
    if params.prompt_logprobs is not None:
        prompt = prompt_logprobs_from_proto(response.prompt_logprobs)
    tokens = list(response.choice_first_token_ids)
    if len(tokens) != params.n - 1:
        raise GenerateError(
            Status.INTERNAL,
            f"prefill node returned {len(tokens)} first tokens for n={params.n} completions",
        )
    lps: list[TokenLogprobs | None] = [None] * len(tokens)
    if params.logprobs is not None and len(response.choice_first_token_logprobs) == len(tokens):
        lps = [logprob_from_proto(m) for m in response.choice_first_token_logprobs]
    choices = list(zip(tokens, lps, strict=True))
    return response.first_token_id, first, prompt, choices, mrope_delta
