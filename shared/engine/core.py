"""The engine core shared by every role; the role-specific halves are mixed in from
`context_role` (prefill node) and `transfer_role` (decode node).

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

import torch

from shared.engine import cpu_threads, malloc_policy
from shared.engine.config import EngineConfig, resolve_device, resolve_dtype
from shared.engine.context_role import ContextRole
from shared.engine.errors import RequestRejected, ResourcesExhausted
from shared.engine.fork import fork_completions, fork_id
from shared.engine.kv_cache import KvLayout, allocate_kv_pool, dtype_name
from shared.engine.logprobs import TokenLogprobs, fill_prompt_logprobs
from shared.engine.output import OutputProcessor, RequestOutput, TokenDelta
from shared.engine.request import (
    ALLOWED_TRANSITIONS,
    FinishReason,
    IllegalStateTransition,
    LlmRequest,
    LlmRequestState,
)
from shared.engine.request_limits import RequestLimits
from shared.engine.resource_manager import (
    KVCacheManager,
    ResourceManager,
    ResourceManagerType,
    SeqSlotManager,
    compute_max_num_sequences,
    validate_seq_slot_pool_covers_admission,
)
from shared.engine.sampler import SampleOutput, Sampler
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from shared.engine.transfer_admission import TransferAdmission
from shared.engine.transfer_role import TransferRole
from shared.model import paged_decode
from shared.model.cuda_graph_runner import DecodeGraphRunner, engine_decode_runner
from shared.model.forward_batch import ForwardBatch, SeqEntry
from shared.model.loader import LoadedModel, load_model

__all__ = ["EngineCore", "RequestOutput", "RequestRejected", "ResourcesExhausted"]

log = logging.getLogger(__name__)

# Called with the step's scheduled requests (before their counters advance); returns a hook that
# the model calls after each layer's K/V are written, or None.
LayerHookFactory = Callable[[Sequence[ScheduledRequest]], Callable[[int], None] | None]
History = tuple[str, list[tuple[LlmRequestState, int | None]]]  # a request's states, their steps


class EngineCore(ContextRole, TransferRole):
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        *,
        context_only: bool = False,
    ):
        config.validate()
        malloc_policy.apply()  # once per process: shared/engine/malloc_policy.py
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
        self.ragged = paged_decode.reads_ragged(self.device, self.dtype)  # decode rows: one group
        self.max_model_len = self._resolve_max_model_len()
        self.max_num_sequences = compute_max_num_sequences(config.max_batch_size)
        block = self.layout.payload_bytes(self.layout.num_layers, 1)  # one block, every layer
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_mb * 2**20 // block)
        self._build_pools(num_blocks)
        self.sampler = Sampler(
            self.max_num_sequences, self.device, self.loaded.eos_token_ids, self.tokenizer
        )
        self.decode_runner = self._build_decode_runner(num_blocks)
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
        self.recent_history: deque[History] = deque(maxlen=1024)  # ended ones: tests, debugging

    @property
    def _uses_cuda_graphs(self) -> bool:
        on_gpu = self.config.cuda_graphs and self.device.type == "cuda" and not self.context_only
        return on_gpu and self.model_config.moe is None  # MoE GEMMs are sized per step's routing

    def _build_pools(self, num_blocks: int) -> None:
        """The KV pool and the two managers over it: blocks (KV) and seats."""
        # CUDA graphs pad decode batches with dummy rows whose K/V land in one scratch block
        # past the BlockManager's blocks (never allocated, never counted); CPU runs eagerly
        scratch = int(self._uses_cuda_graphs)
        self.kv_pool = allocate_kv_pool(self.layout, num_blocks + scratch, self.device)
        self.kv_manager = KVCacheManager(
            num_blocks,
            self.config.block_size,
            self.max_num_sequences,
            self.config.enable_prefix_caching,
        )
        self.seq_slot_manager = SeqSlotManager(self.max_num_sequences)
        validate_seq_slot_pool_covers_admission(self.max_num_sequences, self.kv_manager)
        self.resource_manager = ResourceManager(
            {
                ResourceManagerType.KV_CACHE_MANAGER: self.kv_manager,
                ResourceManagerType.SEQ_SLOT_MANAGER: self.seq_slot_manager,
            }
        )

    def _build_decode_runner(self, num_blocks: int) -> DecodeGraphRunner | None:
        if not self._uses_cuda_graphs:
            return None
        return engine_decode_runner(
            self.model,
            self.kv_pool,
            max_batch_size=self.config.max_batch_size,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            dummy_slot_row=self.sampler.dummy_slot_row,
            scratch_block=num_blocks,
        )

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
        limits = RequestLimits(
            self.model_config.vocab_size,
            self.max_model_len,
            self.config.block_size,
            self.kv_manager.blocks.num_blocks,
            self.max_num_sequences,
            self.context_only,
        )
        limits.check(prompt_token_ids, params)

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
        cpu_threads.follow()  # the CPUs an operator moved the node to, between steps
        with torch.inference_mode():
            scheduled = self._schedule()  # the batch, its seats and KV blocks prepared
            to_sample, logits = self._run_model(scheduled)  # one forward over the paged pool
            sampled = self._sample(to_sample, logits)  # one batched sample
            deltas = self._process(to_sample, sampled)  # tokens out, finished requests freed
        self.admit_queued()  # finished or preempted requests freed blocks
        return deltas

    def admit_queued(self) -> None:
        """Admit what the freed blocks now allow from the decode-side queue (engine thread,
        after every step and command: the only moments blocks free up)."""
        self.admission.admit(self)

    def _schedule(self) -> list[ScheduledRequest]:
        scheduled = self.scheduler.schedule().scheduled
        if not scheduled:
            return []
        self.resource_manager.prepare_resources([s.request for s in scheduled])
        for s in scheduled:
            if s.request.state == LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE:
                s.request.transition(LlmRequestState.GENERATION_IN_PROGRESS)
        return scheduled

    def _run_model(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[list[LlmRequest], torch.Tensor | None]:
        """The requests whose context is complete after this step, and their logits rows
        (followed by any CUDA-graph padding rows, which sample into the scratch row)."""
        if not scheduled:
            return [], None
        batch = [s.request for s in scheduled]
        hook = self.layer_hook_factory(scheduled) if self.layer_hook_factory else None
        entries = [self._entry(s) for s in scheduled]
        logits = self._forward(scheduled, entries, hook)
        sample_rows = [i for i, s in enumerate(scheduled) if s.completes_context]
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        self.resource_manager.update_resources(batch)
        self.num_steps += 1
        if not sample_rows:
            return [], None
        if len(sample_rows) == len(batch):  # every row samples (decode steps): no 6 MB copy
            return batch, logits
        pad_rows = list(range(len(batch), len(logits)))
        return [batch[i] for i in sample_rows], logits[sample_rows + pad_rows]

    def _sample(
        self, to_sample: list[LlmRequest], logits: torch.Tensor | None
    ) -> SampleOutput | None:
        if logits is None:
            return None
        pad = logits.shape[0] - len(to_sample)
        rows: list[LlmRequest | None] = [*to_sample, *[None] * pad]
        return self.sampler.sample_step(rows, logits)

    def _process(
        self, to_sample: list[LlmRequest], sampled: SampleOutput | None
    ) -> list[TokenDelta]:
        if sampled is None:
            return []
        deltas: list[TokenDelta] = []
        n = len(to_sample)
        for r, t, lp, choices in zip(
            to_sample, sampled.tokens[:n], sampled.logprobs[:n], sampled.choices[:n], strict=True
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
            forward = ForwardBatch.build(entries, self.config.block_size, self.device, self.ragged)
            return self.model.forward(forward, self.kv_pool, layer_hook=hook)
        forward = ForwardBatch.build(entries, self.config.block_size, self.device, self.ragged)
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

    # ---- release --------------------------------------------------------------------------
    def free_request_resources(self, request: LlmRequest) -> None:
        """docs/seat-system.md §7: sampler state first, then managers in reverse (KV, then seat)."""
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

    def abort_forks(self, request_id: str) -> None:
        """n > 1: end every completion forked from `request_id`."""
        for fork in list(self.forks.get(request_id, ())):
            if fork in self.requests:
                self.finish_request(self.requests[fork], FinishReason.ABORTED)

    def abort(self, request_id: str) -> LlmRequest | None:
        """End the request and, for n > 1, every completion forked from it."""
        self.abort_forks(request_id)
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
