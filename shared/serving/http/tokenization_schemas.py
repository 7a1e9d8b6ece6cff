"""The bodies of vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info` (its field names and
defaults); the handlers are in shared/serving/http/tokenization.py."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from shared.serving.http.schemas import ChatMessage, TokenId


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: StrictBool = True
    # the template writes its own specials (vLLM's default: none added on top)
    add_special_tokens: StrictBool = False
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    return_token_strs: StrictBool | None = False
    # vLLM's, not implemented here (as on /v1/chat/completions): refused when set
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None  # a client's own Jinja: not run on this server
    # rendered as the chat endpoint renders them (shared/serving/http/tools.py)
    tools: list[Any] | None = None
    functions: list[Any] | None = None  # OpenAI's deprecated tools

    def unsupported_fields(self) -> list[str]:
        no_ops = {"continue_final_message": (False,), "chat_template": (None,)}
        return [name for name, allowed in no_ops.items() if getattr(self, name) not in allowed]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class TokenizerInfoResponse(BaseModel):
    """vLLM's shape: tokenizer_config.json's fields (the ones this server knows) plus the
    chat template."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
