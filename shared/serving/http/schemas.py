"""OpenAI request and response shapes (the subset pdserve serves), as pydantic models.

Unknown fields are ignored, as OpenAI-compatible servers do; fields pdserve knows but does not
implement yet are declared so that `unsupported_fields` can refuse them by name instead of
dropping them silently.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

# Token ids and counts: an int that is not a bool and not a float with no fraction.
TokenId = Annotated[StrictInt, Field(ge=0)]
Prompt = StrictStr | list[TokenId] | list[StrictStr] | list[list[TokenId]]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Sampling(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # known, not implemented yet: refused with a 400 naming them when set
    n: StrictInt | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    logit_bias: dict[str, Any] | None = None
    min_tokens: StrictInt | None = None
    min_p: StrictFloat | None = None
    best_of: StrictInt | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None

    def unsupported_fields(self) -> list[str]:
        """Fields set to something pdserve cannot honour yet (their no-op values pass)."""
        bad = []
        no_ops: dict[str, tuple[object, ...]] = {
            "n": (None, 1),
            "best_of": (None, 1),
            "presence_penalty": (None, 0, 0.0),
            "frequency_penalty": (None, 0, 0.0),
            "repetition_penalty": (None, 1, 1.0),
            "logit_bias": (None, {}),
            "min_tokens": (None, 0),
            "min_p": (None, 0, 0.0),
            "response_format": (None, {"type": "text"}),
            "tools": (None, []),
            "tool_choice": (None, "none"),
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
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        opts = self.stream_options
        return opts is not None and opts.include_usage and opts.continuous_usage_stats


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def _extra_no_ops(self) -> dict[str, tuple[object, ...]]:
        return {"logprobs": (None,), "echo": (False,), "suffix": (None, "")}


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True

    def _extra_no_ops(self) -> dict[str, tuple[object, ...]]:
        return {"logprobs": (None, False), "top_logprobs": (None, 0)}

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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


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
