"""OpenAI request and response shapes (the subset pdserve serves), as pydantic models.

Unknown fields are ignored, as OpenAI-compatible servers do; fields pdserve knows but does not
implement are declared so that `unsupported_fields` can refuse them by name instead of dropping
them silently.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from shared.engine.sampling.sampling_params import MAX_LOGPROBS, MAX_N
from shared.engine.scheduling.service_level import (
    MAX_PRIORITY,
    MAX_SLO_MS,
    MIN_PRIORITY,
    ServiceLevel,
)

# Token ids and counts: an int that is not a bool and not a float with no fraction.
TokenId = Annotated[StrictInt, Field(ge=0)]
Prompt = StrictStr | list[TokenId] | list[StrictStr] | list[list[TokenId]]
TopK = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[StrictFloat, Field(ge=-2, le=2)]  # OpenAI's range


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


# vLLM extensions a client may rely on and pdserve does not implement: refused unless unset or
# at the value pdserve behaves as (vLLM's default)
_VLLM_NO_OPS: dict[str, tuple[object, ...]] = {
    "truncate_prompt_tokens": (None,),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
}


class _Sampling(BaseModel):
    """The fields completions and chat share. Ranges are checked here, so that a bad value is a
    400 naming the field as the client spelled it; engine-level checks (vocabulary, context)
    follow in `DecodeNode.validate`."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: Annotated[StrictFloat, Field(ge=0, le=1)] | None = None  # vLLM extension
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[StrictFloat, Field(gt=0)] | None = None  # vLLM extension
    # OpenAI's shape: token ids as strings -> bias in [-100, 100]
    logit_bias: dict[StrictStr, Annotated[StrictFloat, Field(ge=-100, le=100)]] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None  # vLLM extension
    stop_token_ids: list[TokenId] | None = None  # vLLM extension
    include_stop_str_in_output: StrictBool = False  # vLLM extension
    # admission (shared/engine/scheduling/service_level.py): vLLM's priority, lower first; pdserve's
    # latency targets in ms (a request predicted to miss its TTFT target gets 429 at once)
    priority: Annotated[StrictInt, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)] = 0
    ttft_slo_ms: Annotated[StrictFloat, Field(gt=0, le=MAX_SLO_MS)] | None = None
    itl_slo_ms: Annotated[StrictFloat, Field(gt=0, le=MAX_SLO_MS)] | None = None
    # pdserve's proxy (pdserve/http_resume.py): the output token ids a lost node already
    # streamed of this answer; this node continues it (the gRPC API's `continuation`)
    pdserve_continuation: list[TokenId] | None = None
    # known, not implemented: refused with a 400 naming them when set
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None
    # structured outputs (shared/serving/http/structured.py): OpenAI's and vLLM's spellings
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    # vLLM's, refused by `unsupported_fields` unless at a no-op value (_VLLM_NO_OPS)
    truncate_prompt_tokens: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    use_beam_search: Any = None

    def unsupported_fields(self) -> list[str]:
        """Fields set to something pdserve cannot honour (their no-op values pass)."""
        bad = []
        no_ops: dict[str, tuple[object, ...]] = {
            # best_of = n samples exactly the n completions returned; more would need ranking
            "best_of": (None, self.n or 1),
            **_VLLM_NO_OPS,
            **self._extra_no_ops(),
        }
        for name, allowed in no_ops.items():
            if getattr(self, name) not in allowed:
                bad.append(name)
        return bad

    def _extra_no_ops(self) -> dict[str, tuple[object, ...]]:
        return {}

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def generated_logprobs(self) -> int | None:
        """Alternatives per generated token (None: no logprobs)."""
        return None

    @property
    def service_level(self) -> ServiceLevel:
        return ServiceLevel(self.priority, self.ttft_slo_ms, self.itl_slo_ms)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        opts = self.stream_options
        return opts is not None and opts.include_usage and opts.continuous_usage_stats


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: TopK | None = None
    echo: StrictBool = False
    prompt_logprobs: TopK | None = None  # vLLM extension
    suffix: StrictStr | None = None
    add_special_tokens: StrictBool = True  # vLLM's: the tokenizer's BOS before a text prompt

    def _extra_no_ops(self) -> dict[str, tuple[object, ...]]:
        # tools are chat's (shared/serving/http/tools.py)
        return {"suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none")}

    @property
    def generated_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """What the engine computes for the prompt: echo with logprobs needs them too."""
        echoed = self.logprobs if self.echo else None
        present = [k for k in (self.prompt_logprobs, echoed) if k is not None]
        return max(present) if present else None


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ImageUrl(BaseModel):
    url: StrictStr
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; the processor decides


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class FunctionCall(BaseModel):
    name: StrictStr
    # a JSON string in OpenAI's messages and answers; an object as transformers documents
    arguments: StrictStr | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    id: StrictStr = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool", "function"]
    content: StrictStr | list[TextPart | ImagePart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    function_call: FunctionCall | None = None  # an assistant's call, the deprecated spelling
    tool_call_id: StrictStr | None = None  # a tool's result: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextPart))

    def image_parts(self) -> list[ImagePart]:
        if not isinstance(self.content, list):
            return []
        return [part for part in self.content if isinstance(part, ImagePart)]


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: TopK | None = None
    add_generation_prompt: StrictBool = True
    # extra variables for the chat template (vLLM's; e.g. enable_thinking)
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    continue_final_message: StrictBool = False
    functions: list[Any] | None = None  # OpenAI's deprecated tools
    function_call: Any = None
    parallel_tool_calls: StrictBool | None = None  # False: at most one call (tool_choice)
    # vLLM's: specials added on top of the rendered template (which writes its own)
    add_special_tokens: StrictBool = False
    echo: Any = None  # vLLM's chat echo and prompt logprobs: not implemented for chat
    prompt_logprobs: Any = None

    def _extra_no_ops(self) -> dict[str, tuple[object, ...]]:
        return {
            "continue_final_message": (False,),
            "echo": (None, False),
            "prompt_logprobs": (None,),
        }

    @property
    def generated_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# ---- responses ------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions shape: parallel lists, one entry per token; `top_logprobs`
    maps token text to logprob (the top k, plus the chosen token when it is not among them);
    the first prompt token (echo) has no logprob: null."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry (keyed by the token id as a string)."""

    logprob: float
    rank: int | None = None  # 1-based rank when among the top k computed, else unknown
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    # only when asked (vLLM extension): one per prompt token, the first null
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        default=None, exclude_if=lambda v: v is None
    )


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)
    # the deprecated `functions` shape: the one call (arguments a JSON string)
    function_call: FunctionCall | None = Field(default=None, exclude_if=lambda v: v is None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "function_call"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
