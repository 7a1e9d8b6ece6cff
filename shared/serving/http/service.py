"""The OpenAI API over the decode node's one request path.

A request becomes one or more prompts (a batch is one engine request per prompt, each with its
n completions; choice i * n + j is prompt i's completion j), each prompt runs through
`backend.generate` (the same async generator the gRPC Generate handler consumes), and the deltas
come back as `Piece`s. Nothing here allocates engine resources itself: closing or cancelling a
piece stream releases the request, all n completions, on both nodes.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from shared.engine.info import EngineInfo
from shared.engine.requests.multimodal import PromptImage
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import FinishReason
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.chat_template import RESERVED_VARIABLES, ChatTemplate, ChatTemplateError
from shared.model.loader import LoadedModel
from shared.serving.connection_limits import ConnectionLimits
from shared.serving.http.chat_images import Prompt, request_images, widen_chat_placeholders
from shared.serving.http.errors import ApiError
from shared.serving.http.logprobs import TokenTexts
from shared.serving.http.response_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES
from shared.serving.http.sampling import to_sampling_params
from shared.serving.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    Usage,
)
from shared.serving.http.stream_merge import merge_streams
from shared.serving.http.template_tools import parser_for_template
from shared.serving.http.tools import template_message, tool_definitions
from shared.serving.images.image_limits import ImageLimits

if TYPE_CHECKING:
    from shared.serving.http.tokenization_schemas import TokenizeChatRequest

log = logging.getLogger(__name__)


class RequestStats(Protocol):
    prompt_len: int
    cached_tokens: int
    tokens_by_index: dict[int, int]  # completion tokens of each of the request's n completions


class Backend(Protocol):
    """What the HTTP API needs from the decode node."""

    info: EngineInfo

    def generate(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        deadline: float | None,
        images: Sequence[PromptImage] = (),
    ) -> AsyncIterator[tuple[RequestStats, TokenDelta]]: ...

    def validate(self, prompt: list[int], params: SamplingParams) -> SamplingParams: ...

    async def load_lora(self, name: str, path: str) -> list[str]:
        """Read the adapter at `path` (on the node) and serve it as `name`; LoraUpdateError
        says why not. Returns the prefill nodes that did not take it, each with why."""
        ...

    async def unload_lora(self, name: str) -> list[str]:
        """Stop serving `name`; LoraUpdateError says why not. Returns the prefill nodes that
        did not unload it, each with why."""
        ...

    @property
    def health(self) -> tuple[bool, str]:
        """Whether the node can serve every request now, and why (the /health body)."""
        ...


@dataclass(frozen=True)
class HttpApiConfig:
    served_model_name: str = ""  # "": the model's own name
    api_key: str | None = None  # None: no authentication
    chat_template: ChatTemplate | None = None  # overrides the model's own
    # how "auto" tool choice reads calls (tool_parsers.py); None: the chat template's format
    tool_call_parser: str | None = None
    max_request_bytes: int = 16 * 1024 * 1024
    # stored Responses API answers (response_store.py): at most these bytes and entries
    responses_store_bytes: int = DEFAULT_MAX_BYTES
    responses_store_entries: int = DEFAULT_MAX_ENTRIES
    request_timeout: float | None = None  # seconds; None: no server-side deadline
    # per connection: header and body read deadlines, keep-alive, the connection cap
    connection: ConnectionLimits = field(default_factory=ConnectionLimits)
    runtime_lora: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    image_limits: ImageLimits = field(default_factory=ImageLimits)  # per chat request


@dataclass(frozen=True)
class Job:
    """One prompt of a request: one engine request with params.n completions, its choices
    indexed index * n + j (OpenAI's and vLLM's order)."""

    index: int
    prompt: list[int]
    params: SamplingParams
    prompt_text: str = ""  # what echo prepends (the prompt as given, or its ids decoded)
    images: tuple[PromptImage, ...] = ()  # the prompt's, in placeholder order


@dataclass(frozen=True)
class Piece:
    """One delta of one choice, with its running usage."""

    index: int  # the choice
    job: int  # the prompt it completes
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # this choice's so far
    logprobs: list[TokenLogprobs] | None = None  # one per token of the delta, when asked
    # on a choice's first piece, when the engine computed them: one per prompt token
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    token_ids: tuple[int, ...] = ()  # the delta's tokens, whose text `text` releases


def load_chat_template(path: str, loaded: LoadedModel) -> ChatTemplate:
    """`--chat-template FILE`, with the model's BOS/EOS text as the template's variables."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    if loaded.chat_template is not None:
        own = loaded.chat_template
        return ChatTemplate(source, bos_token=own.bos_token, eos_token=own.eos_token)
    tok = loaded.tokenizer
    bos_ids = [] if tok.bos_token_id is None else [tok.bos_token_id]
    bos = tok.decode(bos_ids, skip_special_tokens=False) if bos_ids else ""
    eos_ids = sorted(tok.eos_token_ids)[:1]
    eos = tok.decode(eos_ids, skip_special_tokens=False) if eos_ids else ""
    return ChatTemplate(source, bos_token=bos, eos_token=eos)


class OpenAIService:
    def __init__(self, backend: Backend, config: HttpApiConfig) -> None:
        self.backend = backend
        self.config = config
        loaded = backend.info.loaded
        self.model_name = config.served_model_name or loaded.name
        self.chat_template = config.chat_template or loaded.chat_template
        # None: the template writes no tool calls, and "auto" answers plain text
        self.tool_call_parser = config.tool_call_parser or parser_for_template(self.chat_template)
        if config.tool_call_parser is None:  # say what "auto" will do, chosen without a flag
            parser = self.tool_call_parser
            how = f"the {parser} parser" if parser else "none: the template writes no calls"
            log.info('tool_choice "auto" reads tool calls with %s (the chat template\'s)', how)
        self.defaults = dict(loaded.generation_defaults)
        self.created = int(time.time())
        self.token_texts = TokenTexts(backend.info.tokenizer)

    @property
    def tokenizer(self):
        return self.backend.info.tokenizer

    def model_card(self) -> ModelCard:
        return ModelCard(
            id=self.model_name,
            created=self.created,
            root=self.backend.info.loaded.name,
            max_model_len=self.backend.info.max_model_len,
        )

    def models(self) -> ModelList:
        """The base model, then each LoRA adapter (vLLM's cards: `parent` is the base)."""
        base = self.model_card()
        adapters = [
            base.model_copy(update={"id": name, "root": str(adapter.path), "parent": base.id})
            for name, adapter in sorted(self.backend.info.lora_adapters.items())
        ]
        return ModelList(data=[base, *adapters])

    def check_model(self, model: str) -> None:
        if model != self.model_name and model not in self.backend.info.lora_adapters:
            adapters = sorted(self.backend.info.lora_adapters)
            served = f"`{self.model_name}`"
            if adapters:
                served += f" and the LoRA adapters {adapters}"
            raise ApiError(
                404,
                f"The model `{model}` does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )

    def adapter(self, model: str) -> str | None:
        """The LoRA adapter a request's `model` names; None: the base model."""
        return None if model == self.model_name else model

    # ---- prompts --------------------------------------------------------------------------
    def completion_prompts(self, req: CompletionRequest) -> list[Prompt]:
        """Each prompt's ids, with its text for echo (token ids given: decoded)."""
        prompt = req.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            batch = [prompt]
        else:
            batch = list(prompt)
        out = []
        for p in batch:
            if isinstance(p, str):
                ids = self.tokenizer.encode(p, add_special_tokens=req.add_special_tokens)
                out.append(Prompt(ids, p))
            else:
                ids = list(p)  # type: ignore[arg-type]
                out.append(Prompt(ids, self.tokenizer.decode(ids) if req.echo else ""))
        return out

    def render_chat(
        self,
        req: ChatCompletionRequest | TokenizeChatRequest,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if self.chat_template is None:
            raise ApiError(
                400,
                f"model `{self.model_name}` has no chat template; use /v1/completions or start "
                "the node with --chat-template FILE",
                param="messages",
                code="no_chat_template",
            )
        messages = [template_message(m) for m in req.messages]
        extra = dict(req.chat_template_kwargs or {})
        reserved = sorted(set(extra) & RESERVED_VARIABLES)
        if reserved:
            raise ApiError(
                400,
                f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them",
                param="chat_template_kwargs",
            )
        try:
            return self.chat_template.render(
                messages, tools=tools, add_generation_prompt=req.add_generation_prompt, **extra
            )
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from None

    def chat_prompt(self, req: ChatCompletionRequest | TokenizeChatRequest) -> Prompt:
        """The rendered conversation's ids and text, and its images (decoded and preprocessed
        here: CPU work, which the routes run off the event loop)."""
        loaded = self.backend.info.loaded
        images = request_images(req.messages, loaded, self.config.image_limits, self.model_name)
        # the template already wrote BOS and the role markers: no second set of specials unless
        # the client asks (vLLM's add_special_tokens)
        text = self.render_chat(req, tool_definitions(req))
        ids = self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        return Prompt(widen_chat_placeholders(ids, images, loaded), text, images)

    def jobs(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: Sequence[Prompt],
    ) -> list[Job]:
        info = self.backend.info
        # a default max_tokens must also fit this node's whole KV pool (EngineInfo.validate)
        limit = min(info.max_model_len, info.pool_tokens)
        jobs = []
        for i, (prompt, text, images) in enumerate(prompts):
            params = to_sampling_params(req, self.defaults, len(prompt), limit)
            adapter = self.adapter(req.model)
            params = replace(params, service=req.service_level, lora_adapter=adapter)
            prompt, params = _continued(req, prompts, prompt, params)
            jobs.append(Job(i, prompt, self.backend.validate(prompt, params), text, images))
        return jobs

    # ---- generation -----------------------------------------------------------------------
    def deadline(self, header: str | None) -> float | None:
        timeouts = [t for t in (self.config.request_timeout, _seconds(header)) if t]
        return time.monotonic() + min(timeouts) if timeouts else None

    async def run(self, rid: str, job: Job, deadline: float | None) -> AsyncIterator[Piece]:
        rid = f"{rid}-{job.index}"
        gen = self.backend.generate(rid, job.prompt, job.params, deadline, job.images)
        n = job.params.n
        started: set[int] = set()
        prompt_logprobs = None  # the prompt's, computed once for all n (on completion 0)
        async with contextlib.aclosing(gen):
            async for stats, delta in gen:
                if delta.finish_reason is FinishReason.ABORTED:
                    raise ApiError(503, "the request was aborted: the node is shutting down")
                if delta.prompt_logprobs is not None:
                    prompt_logprobs = delta.prompt_logprobs
                first = delta.index not in started
                started.add(delta.index)
                finish = None if delta.finish_reason is None else delta.finish_reason.value
                yield Piece(
                    index=job.index * n + delta.index,
                    job=job.index,
                    text=delta.text,
                    finish_reason=finish,
                    prompt_tokens=stats.prompt_len,
                    cached_tokens=stats.cached_tokens,
                    completion_tokens=stats.tokens_by_index.get(delta.index, 0),
                    logprobs=delta.logprobs,
                    prompt_logprobs=prompt_logprobs if first else None,
                    token_ids=tuple(delta.token_ids),
                )

    def pieces(self, rid: str, jobs: list[Job], deadline: float | None) -> AsyncIterator[Piece]:
        streams = [self.run(rid, job, deadline) for job in jobs]
        return streams[0] if len(streams) == 1 else merge_streams(streams)


def usage_of(last: dict[int, Piece]) -> Usage:
    """From each choice's latest piece: the prompt counted once per prompt (its n choices
    share it), completion tokens summed over every choice."""
    prompts = {p.job: p for p in last.values()}
    prompt = sum(p.prompt_tokens for p in prompts.values())
    completion = sum(p.completion_tokens for p in last.values())
    usage = Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
    usage.prompt_tokens_details.cached_tokens = sum(p.cached_tokens for p in prompts.values())
    return usage


def _continued(
    req: CompletionRequest | ChatCompletionRequest,
    prompts: Sequence[Prompt],
    prompt: list[int],
    params: SamplingParams,
) -> tuple[list[int], SamplingParams]:
    """The prompt and params that continue the answer `req.pdserve_continuation` began (the
    proxy's, pdserve/http_resume.py); unchanged without one."""
    done = req.pdserve_continuation
    if not done:
        return prompt, params
    # a batch's answers interleave: only one prompt's answer continues (a grammar's state is
    # rebuilt from the tokens: shared/engine/sampling/grammar_rows.py)
    if len(prompts) > 1:
        raise ApiError(
            400,
            "pdserve_continuation continues one prompt's answer",
            param="pdserve_continuation",
        )
    try:
        return params.continued(prompt, list(done))
    except ValueError as e:
        raise ApiError(400, f"pdserve_continuation: {e}", param="pdserve_continuation") from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _seconds(header: str | None) -> float | None:
    if header is None:
        return None
    try:
        value = float(header)
    except ValueError:
        raise ApiError(400, f"X-Request-Timeout must be seconds, got {header!r}") from None
    if not value > 0:
        raise ApiError(400, f"X-Request-Timeout must be positive, got {header!r}")
    return value
