"""Resource managers and the seat system (docs/seat-system.md §2-§7).

"Seats say who, blocks say how much." A seat (`seq_slot`) is taken after blocks and returned
after them. These classes are pure bookkeeping: no torch, no I/O.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from shared.cdiv import cdiv
from shared.engine.requests.request import LlmRequest, LlmRequestState
from shared.engine.resources.block_manager import (
    BlockHash,
    BlockManager,
    extend_block_hashes,
    lora_seed,
)
from shared.engine.resources.mrope_deltas import MropeDeltaPool
from shared.model.cuda_graph_padding import DUMMY_REQUEST_ID


class NoFreeSlotsError(ValueError):
    pass


class ResourceManagerType(enum.Enum):
    SEQ_SLOT_MANAGER = "seq_slot_manager"
    KV_CACHE_MANAGER = "kv_cache_manager"


class BaseResourceManager(ABC):
    @abstractmethod
    def get_max_resource_count(self) -> int: ...

    @abstractmethod
    def get_needed_resource_to_completion(self, request: LlmRequest) -> int: ...

    def add_dummy_requests(self, request_ids: Iterable[str]) -> None:  # noqa: B027
        pass

    def prepare_resources(self, batch: Sequence[LlmRequest]) -> None:  # noqa: B027
        pass

    def update_resources(self, batch: Sequence[LlmRequest]) -> None:  # noqa: B027
        pass

    def free_resources(self, request: LlmRequest) -> None:  # noqa: B027
        pass

    def shutdown(self) -> None:  # noqa: B027
        pass


class ResourceManager:
    """Ordered managers: prepare in order, free in reverse; the KV manager is moved to the end,
    so it prepares last (it needs the batch's final shape) and frees first (the seat is still
    valid while blocks are released)."""

    def __init__(self, managers: dict[ResourceManagerType, BaseResourceManager]):
        self.managers: OrderedDict[ResourceManagerType, BaseResourceManager] = OrderedDict(managers)
        if ResourceManagerType.KV_CACHE_MANAGER in self.managers:
            self.managers.move_to_end(ResourceManagerType.KV_CACHE_MANAGER)

    def get(self, kind: ResourceManagerType) -> BaseResourceManager:
        return self.managers[kind]

    def add_dummy_requests(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        for manager in self.managers.values():
            manager.add_dummy_requests(ids)

    def prepare_resources(self, batch: Sequence[LlmRequest]) -> None:
        for manager in self.managers.values():
            manager.prepare_resources(batch)

    def update_resources(self, batch: Sequence[LlmRequest]) -> None:
        for manager in self.managers.values():
            manager.update_resources(batch)

    def free_resources(self, request: LlmRequest) -> None:
        for manager in reversed(self.managers.values()):
            manager.free_resources(request)

    def shutdown(self) -> None:
        for manager in reversed(self.managers.values()):
            manager.shutdown()


class SlotManager:
    def __init__(self, max_num_requests: int):
        if max_num_requests <= 0:
            raise ValueError(f"max_num_requests must be positive, got {max_num_requests}")
        self.max_num_requests = max_num_requests
        self.slot_mapping: dict[str, int] = {}
        self.free_slots: set[int] = set(range(max_num_requests))

    def get_slot(self, request_id: str) -> int | None:
        return self.slot_mapping.get(request_id)

    def add_slot(self, request_id: str) -> int:
        if request_id in self.slot_mapping:
            # only the padding dummy may be added twice; anything else is a double-seat bug
            assert request_id == DUMMY_REQUEST_ID, f"request {request_id} already holds a seat"
            return self.slot_mapping[request_id]
        if not self.free_slots:
            raise NoFreeSlotsError(
                f"no free seats: all {self.max_num_requests} are in use ({request_id} asked)"
            )
        slot = min(self.free_slots)  # lowest first keeps sampler rows dense and tests exact
        self.free_slots.remove(slot)
        self.slot_mapping[request_id] = slot
        return slot

    def remove_slot(self, request_id: str) -> None:
        slot = self.slot_mapping.pop(request_id, None)
        if slot is not None:
            self.free_slots.add(slot)

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    @property
    def num_in_use(self) -> int:
        return len(self.slot_mapping)

    def shutdown(self) -> None:
        for request_id in list(self.slot_mapping):
            self.remove_slot(request_id)
        self.check_conservation()

    def check_conservation(self) -> None:
        ok = len(self.slot_mapping) == 0 and len(self.free_slots) == self.max_num_requests
        assert ok, (
            f"seat leak: {len(self.slot_mapping)} seats held {sorted(self.slot_mapping)[:10]}, "
            f"{len(self.free_slots)}/{self.max_num_requests} free"
        )


class SeqSlotManager(BaseResourceManager):
    """Seats, and each seat's mRoPE delta row: written with the seat, cleared before it goes."""

    def __init__(self, max_num_sequences: int):
        self.slot_manager = SlotManager(max_num_sequences)
        self.mrope_deltas = MropeDeltaPool(max_num_sequences)

    def get_max_resource_count(self) -> int:
        return self.slot_manager.max_num_requests

    def get_needed_resource_to_completion(self, request: LlmRequest) -> int:
        return 1

    def add_dummy_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.slot_manager.add_slot(request_id)

    def prepare_resources(self, batch: Sequence[LlmRequest]) -> None:
        for request in batch:
            if request.state == LlmRequestState.DISAGG_GENERATION_INIT:
                continue  # no seat until its KV has arrived
            if request.seq_slot is None:
                request.seq_slot = self.slot_manager.add_slot(request.request_id)
                if request.mrope_delta:
                    self.mrope_deltas.write(
                        request.seq_slot, request.request_id, request.mrope_delta
                    )
                if request.return_perf_metrics and request.first_scheduled_time is None:
                    request.first_scheduled_time = time.monotonic()

    def free_resources(self, request: LlmRequest) -> None:
        if request.seq_slot is not None:
            self.mrope_deltas.clear(request.seq_slot)
        self.slot_manager.remove_slot(request.request_id)
        request.seq_slot = None

    def check_conservation(self) -> None:
        self.slot_manager.check_conservation()
        self.mrope_deltas.check_conservation()

    def shutdown(self) -> None:
        # force-free, as the seats are: the rows of the seats still held go with them
        for seat in self.slot_manager.slot_mapping.values():
            self.mrope_deltas.clear(seat)
        self.slot_manager.shutdown()
        self.mrope_deltas.check_conservation()

    @property
    def num_free(self) -> int:
        return self.slot_manager.num_free

    @property
    def num_in_use(self) -> int:
        return self.slot_manager.num_in_use


class KVCacheManager(BaseResourceManager):
    """Block tables per request over a BlockManager.

    `prepare_resources` grows each scheduled request's table to cover the tokens it computes this
    step (the scheduler has already checked they fit); `update_resources` publishes newly full,
    computed blocks to the prefix cache; `free_resources` drops the request's references.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_sequences: int,
        enable_prefix_caching: bool = True,
        kv_seed: Callable[[str | None], BlockHash] = lora_seed,
    ):
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        # where a request's hash chain starts: what its KV depends on beyond the tokens (the
        # LoRA adapter it runs, and that adapter's files)
        self.kv_seed = kv_seed
        self.block_size = block_size
        self.max_num_sequences = max_num_sequences
        self.block_tables: dict[str, list[int]] = {}
        self.pinned: dict[str, list[int]] = {}
        # chained hashes of each request's computed full blocks, extended as it grows
        self.block_hashes: dict[str, list[BlockHash]] = {}
        # tokens that `prepare_resources` must cover for each request in the current batch
        self.scheduled_tokens: dict[str, int] = {}

    def get_max_resource_count(self) -> int:
        return self.blocks.num_blocks

    def get_needed_resource_to_completion(self, request: LlmRequest) -> int:
        held = len(self.block_tables.get(request.request_id, ()))
        need = cdiv(request.max_total_tokens(), self.block_size)
        if request.forks_pending:  # n > 1: the other completions share only full prompt blocks
            need += (request.sampling_params.n - 1) * (need - request.prompt_len // self.block_size)
        return max(0, need - held)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    # ---- prefix cache ---------------------------------------------------------------------
    def acquire_prefix(self, request: LlmRequest, max_tokens: int | None = None) -> int:
        """Take cached blocks for the request's leading full blocks; returns the tokens covered.
        At most `max_tokens` (default: all but the last token, which must be computed for its
        logits; none while the request's prompt logprobs are still to be computed)."""
        assert request.request_id not in self.block_tables, "prefix acquired twice"
        limit = request.num_tokens - 1 if max_tokens is None else max_tokens
        if max_tokens is None and request.needs_prompt_logits:
            limit = 0  # prompt logprobs need every prompt position's logits computed here
        hashes = self._extend_hashes([], request, max(limit, 0))
        known = hashes[: request.prompt_len // self.block_size]
        if len(known) > len(request.prompt_block_hashes):
            request.prompt_block_hashes = known  # caching its blocks later hashes none again
        hit = self.blocks.match_prefix(hashes)
        self.blocks.acquire(hit)
        self.block_tables[request.request_id] = list(hit)
        return len(hit) * self.block_size

    def needed_to_admit(self, request: LlmRequest, lookahead: int = 1) -> int:
        """Blocks still missing for the request's whole context plus `lookahead` new tokens
        (never past what it can ever hold): what incremental reservation asks at admission."""
        tokens = min(request.num_tokens + lookahead, request.max_total_tokens())
        held = len(self.block_tables.get(request.request_id, ()))
        return max(0, cdiv(max(tokens, request.num_tokens), self.block_size) - held)

    def blocks_to_allocate(self, request: LlmRequest, num_new_tokens: int) -> int:
        held = len(self.block_tables.get(request.request_id, ()))
        need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, need - held)

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    # ---- reservations outside the scheduler (P/D) -----------------------------------------
    def reserve(self, request: LlmRequest, num_tokens: int) -> list[int]:
        """Grow the request's table to cover `num_tokens`; returns the newly allocated blocks."""
        table = self.block_tables.setdefault(request.request_id, [])
        need = cdiv(num_tokens, self.block_size) - len(table)
        new = self.blocks.allocate(need) if need > 0 else []
        table.extend(new)
        return new

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give `child_id` the parent's first `num_tokens` of KV: a shared reference on each
        full block, a fresh block for the partial last one. Returns the (source, copy) block
        pairs whose contents the caller copies, or None when no block is free for the copy
        (the child then holds nothing and recomputes)."""
        assert child_id not in self.block_tables, f"{child_id} already holds blocks"
        table = self.block_tables[parent_id]
        full = num_tokens // self.block_size
        copies: list[tuple[int, int]] = []
        if num_tokens % self.block_size:
            if self.blocks.num_free_blocks < 1:
                return None
            copies.append((table[full], self.blocks.allocate(1)[0]))
        self.blocks.share(table[:full])
        self.block_tables[child_id] = table[:full] + [dst for _, dst in copies]
        self.block_hashes[child_id] = list(self.block_hashes.get(parent_id, [])[:full])
        return copies

    def pin_blocks(self, request_id: str, block_ids: Sequence[int]) -> None:
        self.blocks.pin(block_ids)
        self.pinned.setdefault(request_id, []).extend(block_ids)

    def unpin_request(self, request_id: str) -> None:
        blocks = self.pinned.pop(request_id, [])
        self.blocks.unpin(blocks)

    def cache_computed_blocks(self, request: LlmRequest) -> None:
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        if request.partial_blocks:  # once: they stay unpublished until freed
            self.blocks.mark_partial(request.partial_blocks)
            request.partial_blocks = ()
        hashes = self.block_hashes.setdefault(request.request_id, [])
        done = len(hashes)
        if request.num_computed_tokens // self.block_size <= done:
            return
        self._extend_hashes(hashes, request, request.num_computed_tokens)
        for block_id, h in zip(table[done:], hashes[done:], strict=False):
            self.blocks.cache_block(block_id, h)

    def _extend_hashes(
        self, hashes: list[BlockHash], request: LlmRequest, num_tokens: int
    ) -> list[BlockHash]:
        """Extend `hashes` (in place) to the full blocks of the request's first `num_tokens`:
        from the prompt hashes it came with where they reach, hashing only the rest."""
        full = num_tokens // self.block_size
        known = request.prompt_block_hashes
        if len(hashes) < min(full, len(known)):
            hashes.extend(known[len(hashes) : full])
        if len(hashes) < full:
            seed = self.kv_seed(request.sampling_params.lora_adapter)
            extend_block_hashes(hashes, request.hash_token_ids(num_tokens), self.block_size, seed)
        return hashes

    # ---- BaseResourceManager hooks --------------------------------------------------------
    def prepare_resources(self, batch: Sequence[LlmRequest]) -> None:
        for request in batch:
            num_new = self.scheduled_tokens.get(request.request_id, 0)
            self.reserve(request, request.num_computed_tokens + num_new)

    def update_resources(self, batch: Sequence[LlmRequest]) -> None:
        for request in batch:
            self.cache_computed_blocks(request)

    def free_resources(self, request: LlmRequest) -> None:
        self.scheduled_tokens.pop(request.request_id, None)
        self.block_hashes.pop(request.request_id, None)
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.blocks.free(table)

    def shutdown(self) -> None:
        for request_id in list(self.pinned):
            self.unpin_request(request_id)
        for request_id in list(self.block_tables):
            self.blocks.free(self.block_tables.pop(request_id))
        self.check_conservation()

    def check_conservation(self) -> None:
        assert not self.block_tables, f"block tables still held: {sorted(self.block_tables)[:10]}"
        assert not self.pinned, f"blocks still pinned for: {sorted(self.pinned)[:10]}"
        self.blocks.check_all_free()


def compute_max_num_sequences(
    max_batch_size: int,
    pp_size: int = 1,
    overlap_scheduler: bool = False,
    overlap_headroom: bool = True,
) -> int:
    """The one formula for the seat pool size (docs/seat-system.md §5)."""
    factor = pp_size if pp_size > 1 else 2 if overlap_headroom and overlap_scheduler else 1
    return max_batch_size * factor


def validate_seq_slot_pool_covers_admission(
    max_num_sequences: int, kv_manager: KVCacheManager
) -> None:
    if kv_manager.max_num_sequences < max_num_sequences:
        raise ValueError(
            f"KV cache manager indexes {kv_manager.max_num_sequences} sequences but the seat pool "
            f"has {max_num_sequences}: a seated request would have no block-table row. Raise the "
            "KV manager's max_num_sequences or lower max_batch_size."
        )
    if kv_manager.blocks.num_blocks < max_num_sequences:
        raise ValueError(
            f"KV pool has {kv_manager.blocks.num_blocks} blocks but {max_num_sequences} seats: "
            "every seated request needs at least one block. Add KV blocks or lower max_batch_size."
        )
