"""The engine core shared by every role, and the colocated engine built on it.

`EngineCore.step()` is one iteration of continuous batching: schedule, prepare resources (seats
in order, KV last), one batched forward over the paged pool, one batched sample, then output
processing and release of finished requests in the seat-system order (sampler, KV, seat).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shared.engine.block_manager import NoFreeBlocksError
from shared.engine.config import EngineConfig, resolve_device, resolve_dtype
from shared.engine.fork import fork_completions, fork_id
from shared.engine.kv_cache import KvLayout, allocate_kv_pool, dtype_name
from shared.engine.logprobs import TokenLogprobs, fill_prompt_logprobs
from shared.engine.output import OutputProcessor, TokenDelta
from shared.engine.request import (
    ALLOWED_TRANSITIONS,
    FinishReason,
    IllegalStateTransition,
    LlmRequest,
    LlmRequestState,
)
from shared.engine.resource_manager import (
    KVCacheManager,
    ResourceManager,
    ResourceManagerType,
    SeqSlotManager,
    compute_max_num_sequences,
    validate_seq_slot_pool_covers_admission,
)
from shared.engine.sampler import Sampler
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from shared.engine.transfer_admission import TransferAdmission
from shared.engine.utils import cdiv
from shared.model.attention import ForwardBatch, SeqEntry
from shared.model.cuda_graph_runner import DecodeGraphRunner, engine_decode_runner
from shared.model.loader import LoadedModel, load_model

log = logging.getLogger(__name__)

# Called with the step's scheduled requests (before their counters advance); returns a hook that
# the model calls after each layer's K/V are written, or None.
LayerHookFactory = Callable[[Sequence[ScheduledRequest]], Callable[[int], None] | None]


class RequestRejected(ValueError):
    """Bad input: the message names the field (mapped to INVALID_ARGUMENT)."""


class ResourcesExhausted(RuntimeError):
    """The request is valid but cannot be admitted now (mapped to RESOURCE_EXHAUSTED);
    `retry_after_s` is a hint for the client (HTTP Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    cached_tokens: int
    num_preemptions: int
    logprobs: list[TokenLogprobs] | None = None  # per output token, when asked
    index: int = 0  # which of the prompt's n completions
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token, when asked


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        *,
        context_only: bool = False,
    ):
        config.validate()
        self.config = config
        # a prefill node: a request ends after its first token, its blocks pinned for the push
        self.context_only = context_only
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.loaded = loaded or load_model(config.model, self.device, self.dtype)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.model_config = self.loaded.config
        self.layout: KvLayout = self.model_config.kv_layout(config.block_size, self.dtype)
        self.max_model_len = self._resolve_max_model_len()
        num_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_memory_mb * 2**20 // self._bytes_per_block()
        )
        # CUDA graphs pad decode batches with dummy rows whose K/V land in one scratch block
        # past the BlockManager's blocks (never allocated, never counted); CPU runs eagerly
        graphs = config.cuda_graphs and self.device.type == "cuda" and not context_only
        self.kv_pool = allocate_kv_pool(self.layout, num_blocks + int(graphs), self.device)
        self.max_num_sequences = compute_max_num_sequences(config.max_batch_size)
        self.kv_manager = KVCacheManager(
            num_blocks, config.block_size, self.max_num_sequences, config.enable_prefix_caching
        )
        self.seq_slot_manager = SeqSlotManager(self.max_num_sequences)
        validate_seq_slot_pool_covers_admission(self.max_num_sequences, self.kv_manager)
        self.resource_manager = ResourceManager(
            {
                ResourceManagerType.KV_CACHE_MANAGER: self.kv_manager,
                ResourceManagerType.SEQ_SLOT_MANAGER: self.seq_slot_manager,
            }
        )
        self.sampler = Sampler(self.max_num_sequences, self.device, self.loaded.eos_token_ids)
        self.decode_runner: DecodeGraphRunner | None = None
        if graphs:
            self.decode_runner = engine_decode_runner(
                self.model,
                self.kv_pool,
                max_batch_size=config.max_batch_size,
                max_model_len=self.max_model_len,
                block_size=config.block_size,
                dummy_slot_row=self.sampler.dummy_slot_row,
                scratch_block=num_blocks,
            )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_batch_size, config.max_num_tokens, 0 if context_only else 1),
            self.kv_manager,
            self.seq_slot_manager,
            self.free_request_resources,
        )
        self.outputs = OutputProcessor(self.tokenizer, self.loaded.eos_token_ids)
        self.admission = TransferAdmission()  # decode side: Generate requests waiting for blocks
        self.requests: dict[str, LlmRequest] = {}
        # n > 1: parent id -> its forks' ids, until every completion of the group has ended
        self.forks: dict[str, list[str]] = {}
        self.layer_hook_factory: LayerHookFactory | None = None
        self.num_steps = 0
        # lifecycles of recently ended requests, for tests and debugging
        self.recent_history: deque[tuple[str, list[tuple[LlmRequestState, int | None]]]] = deque(
            maxlen=1024
        )

    def _bytes_per_block(self) -> int:
        return self.layout.num_layers * self.layout.block_bytes_per_layer

    def _resolve_max_model_len(self) -> int:
        model_max = self.model_config.max_context_len
        if self.config.max_model_len and self.config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len {self.config.max_model_len} exceeds the model's context {model_max}"
            )
        return self.config.max_model_len or model_max

    @property
    def kv_dtype_name(self) -> str:
        return dtype_name(self.dtype)

    # ---- admission ------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestRejected naming the field; nothing is allocated before this passes."""
        try:
            params.validate(self.model_config.vocab_size)
        except ValueError as e:
            raise RequestRejected(str(e)) from None
        if not prompt_token_ids:
            raise RequestRejected("prompt is empty: send non-empty text or token_ids")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(f"prompt token id {bad} is out of range [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({len(prompt_token_ids)} tokens) + sampling.max_tokens "
                f"({params.max_tokens}) = {total} exceeds the model's context of "
                f"{self.max_model_len} tokens"
            )
        # never admissible: it could not finish even alone (a prefill node holds the prompt only)
        tokens = len(prompt_token_ids) + (0 if self.context_only else params.max_tokens - 1)
        need = cdiv(tokens, self.config.block_size)
        if not self.context_only:
            # n completions share only the prompt's full blocks
            need += (params.n - 1) * (need - len(prompt_token_ids) // self.config.block_size)
            if params.n > self.max_num_sequences:
                raise RequestRejected(
                    f"sampling.n ({params.n}) exceeds this node's {self.max_num_sequences} seats"
                )
        if need > self.kv_manager.blocks.num_blocks:
            what = "prompt" if self.context_only else "prompt + sampling.max_tokens"
            raise RequestRejected(
                f"request needs {need} KV blocks for its {what} ({tokens} tokens) but this "
                f"node's whole pool has {self.kv_manager.blocks.num_blocks}; it could never "
                "be served here: shorten the prompt or max_tokens"
            )

    def new_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str = "",
        state: LlmRequestState = LlmRequestState.CONTEXT_INIT,
    ) -> LlmRequest:
        self.validate_request(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests or fork_id(request_id, 1) in self.requests:
            raise RequestRejected(f"request_id {request_id!r} is already in flight")
        request = LlmRequest(
            request_id, list(prompt_token_ids), params.with_resolved_seed(), state=state
        )
        self.requests[request_id] = request
        self.outputs.add(request)
        return request

    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str = ""
    ) -> LlmRequest:
        request = self.new_request(prompt_token_ids, params, request_id, LlmRequestState.QUEUED)
        self.scheduler.add_request(request)  # QUEUED there until its blocks are free
        return request

    # ---- one iteration --------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        deltas = self._step()
        self.admit_queued()  # finished or preempted requests freed blocks
        return deltas

    def admit_queued(self) -> None:
        """Admit what the freed blocks now allow from the decode-side queue (engine thread,
        after every step and command: the only moments blocks free up)."""
        self.admission.admit(self)

    @torch.inference_mode()
    def _step(self) -> list[TokenDelta]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        batch = [s.request for s in out.scheduled]
        self.resource_manager.prepare_resources(batch)
        for s in out.scheduled:
            if s.request.state == LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE:
                s.request.transition(LlmRequestState.GENERATION_IN_PROGRESS)
        hook = self.layer_hook_factory(out.scheduled) if self.layer_hook_factory else None
        entries = [self._entry(s) for s in out.scheduled]
        logits = self._forward(out.scheduled, entries, hook)
        sample_rows = [i for i, s in enumerate(out.scheduled) if s.completes_context]
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        self.resource_manager.update_resources(batch)
        self.num_steps += 1
        if not sample_rows:
            return []
        to_sample = [batch[i] for i in sample_rows]
        pad = logits.shape[0] - len(batch)  # CUDA-graph padding rows: the scratch row
        rows: list[LlmRequest | None] = [*to_sample, *[None] * pad]
        pad_rows = list(range(len(batch), len(batch) + pad))
        sampled = self.sampler.sample_step(rows, logits[sample_rows + pad_rows])
        deltas: list[TokenDelta] = []
        for r, t, lp, choices in zip(
            to_sample,
            sampled.tokens[: len(to_sample)],
            sampled.logprobs[: len(to_sample)],
            sampled.choices[: len(to_sample)],
            strict=True,
        ):
            r.choice_first_tokens = choices
            deltas.extend(self._accept_token(r, t, lp))
        return deltas

    def _forward(
        self,
        scheduled: Sequence[ScheduledRequest],
        entries: list[SeqEntry],
        hook: Callable[[int], None] | None,
    ) -> torch.Tensor:
        """Logits of each sequence's last new token (a CUDA-graph step appends its padding rows
        after them); when a request wants prompt logprobs, every token's logits are computed
        and its prompt entries filled from them."""
        if not any(s.request.needs_prompt_logits for s in scheduled):
            if self.decode_runner is not None and hook is None:
                logits = self.decode_runner.run([s.request for s in scheduled], entries)
                if logits is not None:
                    return logits
            forward = ForwardBatch.build(entries, self.config.block_size, self.device)
            return self.model.forward(forward, self.kv_pool, layer_hook=hook)
        forward = ForwardBatch.build(entries, self.config.block_size, self.device)
        every = self.model.forward(forward, self.kv_pool, all_logits=True, layer_hook=hook)
        fill_prompt_logprobs(scheduled, every)
        return every[forward.last_token_index]

    def _entry(self, s: ScheduledRequest) -> SeqEntry:
        r = s.request
        start = r.num_computed_tokens
        return SeqEntry(
            token_ids=r.all_token_ids[start : start + s.num_new_tokens],
            num_computed=start,
            block_table=self.kv_manager.block_table(r.request_id),
        )

    def _accept_token(
        self, request: LlmRequest, token: int, logprobs: TokenLogprobs | None = None
    ) -> list[TokenDelta]:
        now = time.monotonic()
        if request.first_token_time is None:
            request.first_token_time = now
        if self.context_only:
            return [self._finish_context(request, token, logprobs)]
        if request.state == LlmRequestState.CONTEXT_INIT:
            request.transition(LlmRequestState.GENERATION_IN_PROGRESS)
        # forks first: they share the prompt's blocks, which a finishing parent gives back
        forks = fork_completions(self, request) if request.choice_first_tokens else []
        delta = self.outputs.process(request, token, logprobs)
        if delta.finish_reason is not None:
            self.finish_request(request, delta.finish_reason)
        return [delta, *forks]

    # ---- prefill side of P/D -------------------------------------------------------------
    def _finish_context(
        self, request: LlmRequest, token: int, logprobs: TokenLogprobs | None
    ) -> TokenDelta:
        """Last chunk computed: the seat goes back now; the blocks stay pinned until the push
        completes (`complete_context`), so nothing can evict or reuse them mid-send."""
        request.output_token_ids.append(token)
        self.scheduler.remove(request)
        self.kv_manager.pin_blocks(
            request.request_id, self.kv_manager.block_table(request.request_id)
        )
        self.free_request_resources(request)
        request.transition(LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS)
        return TokenDelta(
            request.request_id,
            [token],
            "",
            None,
            logprobs=None if logprobs is None else [logprobs],
            prompt_logprobs=request.prompt_logprobs,
        )

    def complete_context(self, request_id: str, ok: bool) -> None:
        """The push finished (ok) or failed: unpin; the blocks stay in the prefix cache."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.state != LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
            self.finish_request(request, FinishReason.ABORTED, LlmRequestState.DISAGG_TRANS_ERROR)
            return
        self.kv_manager.unpin_request(request_id)
        request.transition(
            LlmRequestState.DISAGG_CONTEXT_COMPLETE if ok else LlmRequestState.DISAGG_TRANS_ERROR
        )
        request.finish_time = time.monotonic()
        self.requests.pop(request_id, None)
        self.outputs.forget(request_id)
        self.recent_history.append((request_id, list(request.history)))

    def context_pushed(self, request_id: str, ok: bool) -> None:
        """The prefill node is done with `request_id` (its push ended, ok or not, or it was
        cancelled before its context was computed): release it either way."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.state == LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
            self.complete_context(request_id, ok)
        else:
            self.abort(request_id)

    # ---- decode side of P/D ---------------------------------------------------------------
    def reserve_for_transfer(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str = ""
    ) -> tuple[LlmRequest, list[int], int]:
        """Admit a request in DISAGG_GENERATION_INIT: blocks reserved (minus this node's own
        prefix-cache hit) and pinned for the incoming transfer, no seat. Returns the request,
        the blocks to fill and the prompt block index of the first of them."""
        request = self.new_request(
            prompt_token_ids, params, request_id, LlmRequestState.DISAGG_GENERATION_INIT
        )
        try:
            # the prefill node computes the prompt (and its logprobs): any hit here is usable
            cached = self.kv_manager.acquire_prefix(request, request.prompt_len - 1)
            request.cached_tokens = cached
            new_blocks = self.kv_manager.reserve(request, request.prompt_len)
        except NoFreeBlocksError:
            self.finish_request(request, FinishReason.ABORTED, LlmRequestState.DISAGG_TRANS_ERROR)
            raise ResourcesExhausted(
                f"no KV blocks free for a {request.prompt_len}-token prompt; retry later"
            ) from None
        self.kv_manager.pin_blocks(request.request_id, new_blocks)
        return request, new_blocks, cached // self.config.block_size

    def start_transfer(self, request_id: str) -> None:
        self._live(request_id).transition(LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS)

    def complete_transfer(
        self,
        request_id: str,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
    ) -> TokenDelta:
        return self.complete_transfer_all(request_id, first_token, first_logprobs, prompt_logprobs)[
            0
        ]

    def complete_transfer_all(
        self,
        request_id: str,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
        choices: Sequence[tuple[int, TokenLogprobs | None]] = (),
    ) -> list[TokenDelta]:
        """All KV landed: the request becomes schedulable (its seat comes at the next prepare);
        the first token, sampled on the prefill node, is processed at once, with the logprobs
        the prefill node computed for it and for the prompt. n > 1: `choices` are the other
        completions' first tokens; they are forked off the landed KV here (deltas after the
        request's own)."""
        request = self._live(request_id)
        if prompt_logprobs is not None:
            request.prompt_logprobs = prompt_logprobs
        # transition first: an illegal call must not drop the pins of a transfer in flight
        request.transition(LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE)
        self.kv_manager.unpin_request(request_id)
        request.num_computed_tokens = request.prompt_len
        self.kv_manager.cache_computed_blocks(request)
        request.first_token_time = time.monotonic()
        request.choice_first_tokens = list(choices)
        forks = fork_completions(self, request) if choices else []
        delta = self.outputs.process(request, first_token, first_logprobs)
        if delta.finish_reason is not None:
            self.finish_request(request, delta.finish_reason)
        else:
            self.scheduler.add_request(request)
        return [delta, *forks]

    def fail_transfer(self, request_id: str) -> None:
        for fork in list(self.forks.get(request_id, ())):
            if fork in self.requests:
                self.finish_request(self.requests[fork], FinishReason.ABORTED)
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, FinishReason.ABORTED, LlmRequestState.DISAGG_TRANS_ERROR)

    def _live(self, request_id: str) -> LlmRequest:
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"request {request_id} is not live (aborted or finished)")
        return request

    # ---- release --------------------------------------------------------------------------
    def free_request_resources(self, request: LlmRequest) -> None:
        """seat-system.md §7: sampler state first, then managers in reverse (KV, then seat)."""
        self.sampler.release_request(request)
        self.resource_manager.free_resources(request)

    def finish_request(
        self,
        request: LlmRequest,
        reason: FinishReason,
        state: LlmRequestState = LlmRequestState.GENERATION_COMPLETE,
    ) -> None:
        self.scheduler.remove(request)
        self.admission.forget(request.request_id)
        self.kv_manager.unpin_request(request.request_id)
        self.free_request_resources(request)
        request.finish_reason = reason
        request.finish_time = time.monotonic()
        if not request.is_finished:
            request.transition(self._terminal_state(request, state))
        self.requests.pop(request.request_id, None)
        self.outputs.forget(request.request_id)
        self.recent_history.append((request.request_id, list(request.history)))
        group = request.group_id
        members = self.forks.get(group)
        if members is not None and not any(m in self.requests for m in (group, *members)):
            del self.forks[group]

    @staticmethod
    def _terminal_state(request: LlmRequest, wanted: LlmRequestState) -> LlmRequestState:
        """`wanted` where the transition table allows it from here, else where an abort ends."""
        allowed = ALLOWED_TRANSITIONS[request.state]
        for state in (
            wanted,
            LlmRequestState.GENERATION_COMPLETE,
            LlmRequestState.DISAGG_TRANS_ERROR,
        ):
            if state in allowed:
                return state
        raise IllegalStateTransition(
            f"request {request.request_id} cannot end from {request.state}"
        )

    def abort(self, request_id: str) -> LlmRequest | None:
        """End the request and, for n > 1, every completion forked from it."""
        for fork in list(self.forks.get(request_id, ())):
            if fork in self.requests:
                self.finish_request(self.requests[fork], FinishReason.ABORTED)
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish_request(request, FinishReason.ABORTED)
        return request

    # ---- introspection --------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def check_conservation(self) -> None:
        """All seats and blocks back in their pools (cached blocks stay evictable)."""
        assert not self.requests, f"requests still live: {sorted(self.requests)[:10]}"
        assert not self.forks, f"completion groups still tracked: {sorted(self.forks)[:10]}"
        self.seq_slot_manager.slot_manager.check_conservation()
        assert self.sampler.seats_in_use() == 0, "sampler rows still owned"
        self.kv_manager.check_conservation()

    def shutdown(self) -> bool:
        """Abort what is left through the normal release path, then check conservation (before
        anything is force-freed, so a leak shows). Returns whether every seat and block was
        back in its pool."""
        for request_id in list(self.requests):
            self.abort(request_id)
        try:
            self.check_conservation()
            conserved = True
        except AssertionError as e:
            log.error("conservation check failed at shutdown: %s", e)
            conserved = False
        with contextlib.suppress(AssertionError):  # already reported; now force-free the rest
            self.resource_manager.shutdown()
        return conserved
