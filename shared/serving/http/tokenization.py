"""vLLM's POST /tokenize and POST /detokenize (lm-evaluation-harness and other clients use them).

Shapes as vLLM serves them: /tokenize takes `{model?, prompt, add_special_tokens=true,
return_token_strs=false}` or `{model?, messages, add_generation_prompt=true,
add_special_tokens=false, chat_template_kwargs?, tools?, functions?, return_token_strs=false}`
(the prompt the chat endpoint would run, its tools rendered alike) and answers `{count,
max_model_len, tokens, token_strs}`; /detokenize takes `{model?, tokens}` and answers `{prompt}`
(the ids decoded with special tokens kept, as vLLM's tokenizer.decode does). `model`, when given,
must be the served name (404 otherwise). Nothing here touches the engine: no request is
admitted, no block allocated.

GET /tokenizer_info is vLLM's too (there behind --enable-tokenizer-info-endpoint): the special
tokens as text and the chat template the server runs. lm-evaluation-harness's `local-completions`
looks for it (with /tokenize) to count tokens through the server, so that it needs no tokenizer
files of its own; pdserve serves it whenever the API is on (same API key as /v1).
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from shared.model.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer
from shared.serving.http.errors import ApiError
from shared.serving.http.logprobs import TokenTexts
from shared.serving.http.service import OpenAIService
from shared.serving.http.tokenization_schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)


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
        ids = service.chat_prompt(request).ids  # exactly the chat endpoint's (images widened)
    else:
        ids = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    strs = token_strs(tokenizer, service.token_texts, ids) if request.return_token_strs else None
    return TokenizeResponse(
        count=len(ids),
        max_model_len=service.backend.info.max_model_len,
        tokens=ids,
        token_strs=strs,
    )


def detokenize(service: OpenAIService, request: DetokenizeRequest) -> DetokenizeResponse:
    if request.model is not None:
        service.check_model(request.model)
    vocab = service.backend.info.vocab_size
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


def tokenizer_info(service: OpenAIService) -> TokenizerInfoResponse:
    tokenizer = service.tokenizer
    template = service.chat_template

    def text_of(token_id: int | None) -> str | None:
        if token_id is None:
            return None
        return tokenizer.decode([token_id], skip_special_tokens=False)

    # the template's own specials where it names them (what it renders); else the ids' text.
    # Of several end-of-generation ids the lowest is the tokenizer's own EOS (the others are
    # end-of-turn markers added from generation_config.json or the GGUF metadata)
    eos_ids = sorted(tokenizer.eos_token_ids)
    eos = (template.eos_token if template else "") or text_of(eos_ids[0] if eos_ids else None)
    bos = (template.bos_token if template else "") or text_of(tokenizer.bos_token_id)
    pad_id = tokenizer.pad_token_id if isinstance(tokenizer, ByteTokenizer) else None
    return TokenizerInfoResponse(
        tokenizer_class=(
            "PreTrainedTokenizerFast" if isinstance(tokenizer, HfTokenizer) else "ByteTokenizer"
        ),
        bos_token=bos,
        eos_token=eos,
        pad_token=text_of(pad_id),
        chat_template=template.source if template else None,
        model_max_length=service.backend.info.max_model_len,
        vocab_size=tokenizer.vocab_size,
    )


def token_strs(tokenizer: Tokenizer, texts: TokenTexts, ids: list[int]) -> list[str]:
    """vLLM's `token_strs`: each id's vocabulary entry (convert_ids_to_tokens, e.g. "Ġthe")
    where the tokenizer has a vocabulary of strings; a byte tokenizer's ids decode alone."""
    if isinstance(tokenizer, HfTokenizer):
        backend = tokenizer.backend
        return [backend.id_to_token(i) or texts(i) for i in ids]
    return [texts(i) for i in ids]
