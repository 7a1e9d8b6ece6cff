"""n > 1: completions 1..n-1 forked from completion 0 once its prompt is computed.

The prompt is computed (and, in P/D, pushed) once. Each fork holds a reference on the prompt's
full blocks and a copy of the partial last block (a completion writes its own tokens there),
its first token (drawn with the parent's from the same logits, from its own stream
`choice_seed(seed, i)`) and waits for a seat like any request whose KV is in place. When no block
is free for the copy, the fork holds nothing and recomputes its prompt when admitted.
"""

from __future__ import annotations

from dataclasses import replace

from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import LlmRequest
from shared.engine.requests.request_table import fork_id
from shared.engine.roles.role import EngineParts
from shared.engine.sampling.sampler import choice_seed


def fork_completions(parts: EngineParts, parent: LlmRequest) -> list[TokenDelta]:
    """Fork the parent's pending completions; returns their first-token deltas."""
    choices, parent.choice_first_tokens = parent.choice_first_tokens, []
    seed = parent.sampling_params.seed or 0
    table = parts.requests
    deltas = []
    for index, (token, logprobs) in enumerate(choices, start=1):
        params = replace(
            parent.sampling_params, n=1, seed=choice_seed(seed, index), prompt_logprobs=None
        )
        child = LlmRequest(
            fork_id(parent.request_id, index),
            list(parent.prompt_token_ids),
            params,
            state=parent.state,
            parent_id=parent.request_id,
            choice_index=index,
            multimodal=parent.multimodal,
            mrope_delta=parent.mrope_delta,
        )
        child.cached_tokens = parent.cached_tokens
        child.first_token_time = parent.first_token_time
        table.add_fork(child)
        copies = parts.kv_manager.fork(parent.request_id, child.request_id, parent.prompt_len)
        if copies is not None:
            parts.runner.copy_blocks(copies)
            child.num_computed_tokens = parent.prompt_len
        delta = table.outputs.process(child, token, logprobs)
        if delta.finish_reason is not None:
            table.finish(child, delta.finish_reason)
        else:
            parts.scheduler.add_request(child)
        deltas.append(delta)
    return deltas
