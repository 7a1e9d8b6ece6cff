"""The one mapping from an OpenAI request to SamplingParams.

Each field comes from the request, else the model's generation_config.json (vLLM's overridable
set), else OpenAI's default. Ranges were checked by the schemas (400 naming the field as the
client spelled it); the engine's own checks (vocabulary, context, pool) follow in
`DecodeNode.validate`.
"""

from __future__ import annotations

from typing import Any

from shared.engine.sampling.sampling_params import SamplingParams
from shared.serving.http.errors import ApiError
from shared.serving.http.schemas import ChatCompletionRequest, CompletionRequest
from shared.serving.http.structured import structured_output

# OpenAI's defaults for what neither the request nor generation_config.json sets
OPENAI_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def to_sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    defaults: dict[str, Any],
    prompt_len: int,
    context_limit: int,
) -> SamplingParams:
    """SamplingParams for one prompt of `req` (a batch maps each prompt alike)."""
    _refuse_unsupported(req)
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        room = max(1, context_limit - prompt_len)
        chat = isinstance(req, ChatCompletionRequest)
        fallback = room if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        max_tokens = min(int(defaults.get("max_new_tokens") or fallback), room)

    def pick(name: str) -> Any:
        value = getattr(req, name)
        if value is not None:
            return value
        return defaults.get(name, OPENAI_DEFAULTS[name])

    top_k = int(pick("top_k"))
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    prompt_logprobs = req.engine_prompt_logprobs if isinstance(req, CompletionRequest) else None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(pick("temperature")),
        top_p=float(pick("top_p")),
        top_k=0 if top_k == -1 else top_k,  # -1 is vLLM's spelling of "off"
        min_p=float(pick("min_p")),
        seed=req.seed,
        stop=stop,
        ignore_eos=req.ignore_eos,
        logprobs=req.generated_logprobs,
        prompt_logprobs=prompt_logprobs,
        repetition_penalty=float(pick("repetition_penalty")),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=_logit_bias(req.logit_bias),
        min_tokens=req.min_tokens or 0,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        n=req.n or 1,
        include_stop_str_in_output=req.include_stop_str_in_output,
        structured=structured_output(req),
    )


def _refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    unsupported = req.unsupported_fields()
    if unsupported:
        raise ApiError(
            400,
            f"not supported by pdserve: {', '.join(unsupported)}"
            + (" (best_of must equal n)" if "best_of" in unsupported else ""),
            param=unsupported[0],
            code="unsupported_parameter",
        )
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's keys are token ids written as strings; the engine checks them against the
    vocabulary."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0 or key.strip() != key:
            raise ApiError(
                400,
                f"logit_bias keys must be token ids, got {key!r}",
                param="logit_bias",
            )
        out[token] = float(value)
    return out
