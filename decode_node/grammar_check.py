"""Structured outputs on the decode node: the grammar compiled before a gRPC request is queued,
and the prefill node's first tokens checked against it before the engine takes them.

A first token the grammar rejects (a prefill node with another model, tokenizer or a bug) is
refused with INTERNAL instead of being streamed: the output would silently break its schema.
"""

from __future__ import annotations

from decode_node.prefill_answer import FirstTokens
from shared.engine.errors import ResourcesExhausted
from shared.engine.info import EngineInfo
from shared.engine.sampling.grammar_compiler import GrammarError, compile_async, compiler_for
from shared.engine.sampling.sampling_params import SamplingParams
from shared.serving.grpc_server import GenerateError
from shared.serving.status import Status


async def with_grammar(
    info: EngineInfo, prompt: list[int], params: SamplingParams, deadline: float | None = None
) -> tuple[list[int], SamplingParams]:
    """(prompt, params) once params' grammar is compiled (in a compile worker, stopped at the
    request's `deadline`, monotonic seconds, or the compile time limit)."""
    if params.structured is not None:
        try:
            await compile_async(
                info.tokenizer, info.vocab_size, params.structured, deadline=deadline
            )
        except GrammarError as e:
            raise GenerateError(Status.INVALID_ARGUMENT, f"{e.field}: {e}") from None
        except ResourcesExhausted as e:  # no compile worker free in time, or no room
            raise GenerateError(Status.RESOURCE_EXHAUSTED, f"sampling.structured: {e}") from None
    return prompt, params


def check_first_tokens(
    info: EngineInfo, prompt: list[int], params: SamplingParams, first: FirstTokens
) -> None:
    spec = params.structured
    if spec is None:
        return
    compiler = compiler_for(info.tokenizer, info.vocab_size)
    earlier = params.continued_part(prompt)  # a continued answer's grammar resumes after it
    token, _, _, choices, _ = first
    for t in (token, *(c for c, _ in choices)):
        if not compiler.allows(spec, [*earlier, t]):
            raise GenerateError(
                Status.INTERNAL,
                f"the prefill node's first token {t} is not allowed by the request's "
                f"{spec.kind}; refusing it (do both nodes serve the same model and tokenizer?)",
            )
