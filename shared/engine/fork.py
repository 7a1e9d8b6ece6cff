"""n > 1: completions 1..n-1 forked from completion 0 once its prompt is computed.

The prompt is computed (and, in P/D, pushed) once. Each fork holds a reference on the prompt's
full blocks and a copy of the partial last block (a completion writes its own tokens there),
its first token (drawn with the parent's from the same logits, from its own stream
`choice_seed(seed, i)`) and waits for a seat like any request whose KV is in place. When no block
is free for the copy, the fork holds nothing and recomputes its prompt when admitted.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from shared.engine.request import LlmRequest
from shared.engine.sampler import choice_seed

if TYPE_CHECKING:
    from shared.engine.core import EngineCore
    from shared.engine.output import TokenDelta


def fork_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#{index}"


def fork_completions(core: EngineCore, parent: LlmRequest) -> list[TokenDelta]:
    """Fork the parent's pending completions; returns their first-token deltas."""
    choices, parent.choice_first_tokens = parent.choice_first_tokens, []
    seed = parent.sampling_params.seed or 0
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
        )
        child.cached_tokens = parent.cached_tokens
        child.first_token_time = parent.first_token_time
        core.requests[child.request_id] = child
        core.forks.setdefault(parent.request_id, []).append(child.request_id)
        core.outputs.add(child)
        copies = core.kv_manager.fork(parent.request_id, child.request_id, parent.prompt_len)
        if copies is not None:
            for src, dst in copies:
                core.kv_pool[:, :, dst].copy_(core.kv_pool[:, :, src])
            child.num_computed_tokens = parent.prompt_len
        delta = core.outputs.process(child, token, logprobs)
        if delta.finish_reason is not None:
            core.finish_request(child, delta.finish_reason)
        else:
            core.scheduler.add_request(child)
        deltas.append(delta)
    return deltas
