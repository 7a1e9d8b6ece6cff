"""The engine: one model, its KV pool, its seats, and the continuous batch over them.

`EngineCore.step()` is one iteration of continuous batching: schedule, prepare resources (seats
in order, KV last), one batched forward over the paged pool, one batched sample, then output
processing and release of finished requests in the seat-system order (sampler, KV, seat). What a
sampled token means (the prompt's KV handed to a push, or the next token of a completion) and
the commands beyond the common ones belong to the engine's role (shared/engine/roles/role.py),
which its node gives it; where KV comes from or goes to beyond the pool belongs to the role's KV
connector (shared/engine/connector/). The core names neither a role nor a connector. Nodes drive
an engine only through commands (shared/engine/commands.py) on its thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import torch

from shared.engine.commands import Abort, AddRequest, Shutdown, WarmUp
from shared.engine.config import EngineConfig
from shared.engine.errors import RequestRejected, ResourcesExhausted
from shared.engine.info import EngineInfo
from shared.engine.lora_updates import LoraUpdates
from shared.engine.requests.multimodal import PromptImage
from shared.engine.requests.output import OutputProcessor, RequestOutput, TokenDelta
from shared.engine.requests.request import LlmRequest, LlmRequestState
from shared.engine.requests.request_limits import RequestLimits
from shared.engine.requests.request_table import RequestTable
from shared.engine.resources.resource_manager import (
    KVCacheManager,
    ResourceManager,
    ResourceManagerType,
    SeqSlotManager,
    compute_max_num_sequences,
    validate_seq_slot_pool_covers_admission,
)
from shared.engine.roles.role import Emit, EngineParts, Role, RoleSettings
from shared.engine.runtime import cpu_threads, kv_budget, malloc_policy
from shared.engine.runtime.model_runner import ModelRunner, draft_rows
from shared.engine.runtime.warmup import warm_up
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.engine.sampling.sampler import SampleOutput, Sampler
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.scheduling.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from shared.engine.speculative.config import SpeculativeConfig
from shared.engine.speculative.draft_model import check_same_tokenizer, draft_config
from shared.engine.speculative.drafter import Drafter
from shared.engine.speculative.proposer import Proposer, build_proposer
from shared.kv.layout import KvLayout, dtype_name
from shared.model.device import resolve_device, resolve_dtype
from shared.model.loader import LoadedModel, load_model

__all__ = ["EngineCore", "RequestOutput", "RequestRejected", "ResourcesExhausted"]

log = logging.getLogger(__name__)
S = LlmRequestState


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        *,
        role: RoleSettings,
    ):
        config.validate()
        malloc_policy.apply()  # once per process: shared/engine/runtime/malloc_policy.py
        settings = role
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.loaded = loaded or load_model(config.model, self.device, self.dtype)
        self.tokenizer = self.loaded.tokenizer
        self.model_config = self.loaded.config
        self.layout: KvLayout = self.model_config.kv_layout(config.block_size, self.dtype)
        self.max_num_sequences = compute_max_num_sequences(config.max_batch_size)
        # after the weights: a memory-sized pool takes a share of what they left free
        context = self.model_config.max_context_len
        self.pool_size = kv_budget.engine_pool(config, self.layout, self.device, context)
        num_blocks = self.pool_size.num_blocks
        # a context-only engine's pool holds prompts only: it bounds the prompt (RequestLimits),
        # not the context a decode node serves
        bounded_by = None if settings.context_only else self.pool_size
        self.max_model_len = kv_budget.served_context(context, config.max_model_len, bounded_by)
        log.info("%s; max_model_len %d", self.pool_size.describe(), self.max_model_len)
        self._build_managers(num_blocks)
        self.sampler = Sampler(
            self.max_num_sequences, self.device, self.loaded.eos_token_ids, self.tokenizer
        )
        self.runner = self._build_runner(num_blocks, settings.context_only)
        spec = None if settings.context_only else config.speculative  # it decodes nothing
        self.drafter = None if spec is None else Drafter(spec, self._proposer(spec, settings))
        self._draft_logits: dict[str, torch.Tensor] = {}  # this step's, by request
        self.connector = settings.connector(self.kv_manager)
        self.connector.register_kv_pool(self.runner.kv_pool)
        # a context-only request ends at its first token: no block for a token after it
        lookahead = 0 if settings.context_only else 1
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_batch_size, config.max_num_tokens, lookahead),
            self.kv_manager,
            self.seq_slot_manager,
            self.free_request_resources,
            connector=self.connector,
            hold=settings.hold(),
        )
        self.table = self._build_table(num_blocks, settings.context_only)
        self.parts = EngineParts(
            config, self.table, self.kv_manager, self.scheduler, self.runner, self.connector
        )
        self.role: Role = settings.build(self.parts)
        self._handlers: dict[type, Callable[[Any], Any]] = {
            AddRequest: lambda c: self.add_request(c.prompt, c.params, c.request_id, c.images),
            Abort: lambda c: self.abort(c.request_id),
            WarmUp: lambda c: warm_up(self.parts, self.max_model_len),
            Shutdown: lambda c: self.shutdown(),
            **LoraUpdates(self.loaded.model.lora, lambda: self.requests.values()).handlers(),
            **self.role.handlers(),
        }

    def _proposer(self, spec: SpeculativeConfig, settings: RoleSettings) -> Proposer:
        """The method's proposer; a draft model runs in an engine of its own beside this one."""

        def draft_engine() -> EngineCore:
            config = draft_config(self.config, spec, self.pool_size.num_blocks)
            draft = EngineCore(config, role=settings.drafting())
            check_same_tokenizer(self.loaded, draft.loaded)
            return draft

        return build_proposer(spec, draft_engine)

    def _build_managers(self, num_blocks: int) -> None:
        """The two managers over the pool: blocks (KV) and seats."""
        self.kv_manager = KVCacheManager(
            num_blocks,
            self.config.block_size,
            self.max_num_sequences,
            self.config.enable_prefix_caching,
            lambda adapter: self.info.kv_seed(adapter),
        )
        self.seq_slot_manager = SeqSlotManager(self.max_num_sequences)
        validate_seq_slot_pool_covers_admission(self.max_num_sequences, self.kv_manager)
        self.resource_manager = ResourceManager(
            {
                ResourceManagerType.KV_CACHE_MANAGER: self.kv_manager,
                ResourceManagerType.SEQ_SLOT_MANAGER: self.seq_slot_manager,
            }
        )

    def _build_runner(self, num_blocks: int, context_only: bool) -> ModelRunner:
        # CUDA graphs on a GPU only, not on a prefill node (its steps carry a layer hook), not
        # for MoE (its GEMMs are sized per step by the routing)
        graphs = self.config.cuda_graphs and self.device.type == "cuda" and not context_only
        return ModelRunner(
            self.loaded,
            self.config,
            self.layout,
            num_blocks,
            self.device,
            cuda_graphs=graphs and self.model_config.moe is None,
            max_model_len=self.max_model_len,
            dummy_slot_row=self.sampler.dummy_slot_row,
            mrope_deltas=self.seq_slot_manager.mrope_deltas,
        )

    def _build_table(self, num_blocks: int, context_only: bool) -> RequestTable:
        """The live requests, and the limits every new one is checked against."""
        vision = self.model_config.vision
        self.limits = RequestLimits(
            self.model_config.vocab_size,
            self.max_model_len,
            self.config.block_size,
            num_blocks,
            self.max_num_sequences,
            context_only,
            self.loaded.model.lora_names,
            self.model_config.image_token_id,
            1 if vision is None else vision.spatial_merge_size,
        )
        outputs = OutputProcessor(self.tokenizer, self.loaded.eos_token_ids)
        return RequestTable(
            self.limits, self.scheduler, self.kv_manager, outputs, self.free_request_resources
        )

    # ---- the door -------------------------------------------------------------------------
    def execute(self, command: object) -> Any:
        """Run one command (shared/engine/commands.py); engine thread only."""
        handler = self._handlers.get(type(command))
        if handler is None:
            raise TypeError(f"{type(command).__name__} is not a command this engine runs")
        return handler(command)

    @cached_property
    def info(self) -> EngineInfo:
        return EngineInfo(
            loaded=self.loaded,
            architecture=self.model_config.architecture,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.loaded.eos_token_ids,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            num_kv_blocks=self.kv_manager.blocks.num_blocks,
            num_offload_blocks=self.connector.offload_blocks(),
            pool_size=self.pool_size,
            layout=self.layout,
            kv_pool=self.runner.kv_pool,
            device_type=self.device.type,
            limits=self.limits,
        )

    # ---- the parts, by name (tests, benchmarks, the engine thread) ------------------------
    @property
    def context_only(self) -> bool:
        return self.role.context_only

    @property
    def requests(self) -> dict[str, LlmRequest]:
        return self.table.requests

    @property
    def forks(self) -> dict[str, list[str]]:
        return self.table.forks

    @property
    def outputs(self) -> OutputProcessor:
        return self.table.outputs

    @property
    def recent_history(self):
        return self.table.recent_history

    @property
    def num_steps(self) -> int:
        return self.parts.num_steps

    @property
    def model(self):
        return self.runner.model

    @property
    def kv_pool(self) -> torch.Tensor:
        return self.runner.kv_pool

    @property
    def decode_runner(self):
        return self.runner.decode_runner

    @property
    def kv_dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def bind_events(self, emit: Emit) -> None:
        """Where the role's events (e.g. admission grants) go: the engine thread's poster."""
        self.role.bind(emit)

    # ---- admission ------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestRejected naming the field; nothing is allocated before this passes."""
        self.limits.check(prompt_token_ids, params)

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str = "",
        images: Sequence[PromptImage] = (),
    ) -> LlmRequest:
        request = self.table.new(prompt_token_ids, params, request_id, S.QUEUED, images)
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
        self.role.after_step()  # finished or preempted requests freed blocks
        return deltas

    def admit_queued(self) -> None:
        """What the role does whenever blocks may have freed up (after steps and commands)."""
        self.role.after_step()

    def _schedule(self) -> list[ScheduledRequest]:
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running)
        scheduled = self.scheduler.schedule().scheduled
        if not scheduled:
            return []
        self.resource_manager.prepare_resources([s.request for s in scheduled])
        for s in scheduled:
            if s.request.state == S.DISAGG_GENERATION_TRANS_COMPLETE:
                s.request.transition(S.GENERATION_IN_PROGRESS)
        return scheduled

    def _run_model(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[list[LlmRequest], torch.Tensor | None]:
        """The requests whose context is complete after this step, and their logits rows
        (followed by any CUDA-graph padding rows, which sample into the scratch row)."""
        if not scheduled:
            return [], None
        batch = [s.request for s in scheduled]
        self.connector.start_load_kv(scheduled)
        hook = self.connector.layer_hook(scheduled)
        logits = self.runner.forward(scheduled, self.kv_manager.block_table, hook)
        self.connector.wait_for_save()
        logits, self._draft_logits = draft_rows(scheduled, logits)
        sample_rows = [i for i, s in enumerate(scheduled) if s.completes_context]
        for s in scheduled:  # drafts count once verified (_process)
            s.request.num_computed_tokens += s.num_new_tokens - len(s.request.draft_token_ids)
        self.resource_manager.update_resources(batch)
        self.parts.num_steps += 1
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
        now = time.monotonic()
        rows = zip(
            to_sample, sampled.tokens[:n], sampled.logprobs[:n], sampled.choices[:n], strict=True
        )
        for i, (r, t, lp, choices) in enumerate(rows):
            if r.first_token_time is None:
                r.first_token_time = now
            if i in sampled.failed:  # its grammar failed: that request ends, the batch goes on
                deltas.extend(self.role.end_with_error(r, t, lp, sampled.failed[i]))
                continue
            r.choice_first_tokens = choices
            step = self._verified(r, (t, lp))
            tokens, logprobs = [s[0] for s in step], [s[1] for s in step]
            deltas.extend(self.role.accept_tokens(r, tokens, logprobs))
        return deltas

    def _verified(
        self, request: LlmRequest, first: tuple[int, TokenLogprobs | None]
    ) -> list[tuple[int, TokenLogprobs | None]]:
        """The step's tokens for `request`: the sampled one, then those its accepted drafts
        let through (requests with a grammar are not drafted for)."""
        rows = self._draft_logits.pop(request.request_id, None)
        if rows is None or self.drafter is None:
            return [first]
        return self.drafter.verify(request, first, self.sampler.draw_drafts(request, rows))

    # ---- release --------------------------------------------------------------------------
    def free_request_resources(self, request: LlmRequest) -> None:
        """docs/seat-system.md §7: sampler state first, then managers in reverse (KV, then seat)."""
        self.sampler.release_request(request)
        self.resource_manager.free_resources(request)

    def abort(self, request_id: str) -> LlmRequest | None:
        """End the request and, for n > 1, every completion forked from it."""
        return self.table.abort(request_id)

    # ---- introspection --------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def check_conservation(self) -> None:
        """All seats and blocks back in their pools (cached blocks stay evictable)."""
        self.table.check_empty()
        self.seq_slot_manager.check_conservation()
        assert self.sampler.seq_slots_in_use() == 0, "sampler rows still owned"
        self.kv_manager.check_conservation()

    def shutdown(self) -> bool:
        """Abort what is left through the normal release path, then check conservation (before
        anything is force-freed, so a leak shows). Returns whether every seat and block was
        back in its pool."""
        for request_id in list(self.requests):
            self.abort(request_id)
        self.connector.shutdown()  # every block released, its bytes still valid
        try:
            self.check_conservation()
            conserved = True
        except AssertionError as e:
            log.error("conservation check failed at shutdown: %s", e)
            conserved = False
        with contextlib.suppress(AssertionError):  # already reported; now force-free the rest
            self.resource_manager.shutdown()
        return conserved
