"""vLLM's POST /tokenize and POST /detokenize (lm-evaluation-harness and other clients use them).

Shapes as vLLM serves them: /tokenize takes `{model?, prompt, add_special_tokens=true,
return_token_strs=false}` or `{model?, messages, add_generation_prompt=true,
add_special_tokens=false, chat_template_kwargs?, return_token_strs=false}` (the prompt the chat
endpoint would run) and answers `{count, max_model_len, tokens, token_strs}`; /detokenize takes
`{model?, tokens}` and answers `{prompt}` (the ids decoded with special tokens kept, as vLLM's
tokenizer.decode does). `model`, when given, must be the served name (404 otherwise). Nothing
here touches the engine: no request is admitted, no block allocated.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from shared.model.tokenizer import HfTokenizer, Tokenizer
from shared.serving.http.errors import ApiError
from shared.serving.http.logprobs import TokenTexts
from shared.serving.http.schemas import ChatMessage, TokenId
from shared.serving.http.service import OpenAIService


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
    tools: list[Any] | None = None

    def unsupported_fields(self) -> list[str]:
        no_ops = {
            "continue_final_message": (False,),
            "chat_template": (None,),
            "tools": (None, []),
        }
        return [name for name, allowed in no_ops.items() if getattr(self, name) not in allowed]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


def parse_tokenize(body: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """Chat when the body has `messages`, else completion (vLLM's union, told apart by its
    fields so that an error names the field of the shape the client meant)."""
    shape = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    try:
        request = shape.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    if isinstance(request, TokenizeChatRequest):
        unsupported = request.unsupported_fields()
        if unsupported:
            raise ApiError(400, f"{', '.join(unsupported)} is not supported", param=unsupported[0])
    return request


def tokenize(
    service: OpenAIService, request: TokenizeCompletionRequest | TokenizeChatRequest
) -> TokenizeResponse:
    if request.model is not None:
        service.check_model(request.model)
    tokenizer = service.tokenizer
    if isinstance(request, TokenizeChatRequest):
        text = service.render_chat(request)
    else:
        text = request.prompt
    ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    strs = token_strs(tokenizer, service.token_texts, ids) if request.return_token_strs else None
    return TokenizeResponse(
        count=len(ids),
        max_model_len=service.backend.core.max_model_len,
        tokens=ids,
        token_strs=strs,
    )


def detokenize(service: OpenAIService, request: DetokenizeRequest) -> DetokenizeResponse:
    if request.model is not None:
        service.check_model(request.model)
    vocab = service.backend.core.model_config.vocab_size
    bad = next((i for i, t in enumerate(request.tokens) if t >= vocab), None)
    if bad is not None:
        raise ApiError(
            400,
            f"tokens.{bad}: token id {request.tokens[bad]} is not below the vocabulary size "
            f"{vocab}",
            param="tokens",
        )
    return DetokenizeResponse(
        prompt=service.tokenizer.decode(request.tokens, skip_special_tokens=False)
    )


def token_strs(tokenizer: Tokenizer, texts: TokenTexts, ids: list[int]) -> list[str]:
    """vLLM's `token_strs`: each id's vocabulary entry (convert_ids_to_tokens, e.g. "Ġthe")
    where the tokenizer has a vocabulary of strings; a byte tokenizer's ids decode alone."""
    if isinstance(tokenizer, HfTokenizer):
        backend = tokenizer.backend
        return [backend.id_to_token(i) or texts(i) for i in ids]
    return [texts(i) for i in ids]
