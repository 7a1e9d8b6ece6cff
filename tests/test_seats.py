from __future__ import annotations

import pytest

from shared.engine.requests.request import LlmRequest, LlmRequestState
from shared.engine.resources.resource_manager import (
    DUMMY_REQUEST_ID,
    BaseResourceManager,
    KVCacheManager,
    NoFreeSlotsError,
    ResourceManager,
    ResourceManagerType,
    SeqSlotManager,
    SlotManager,
    compute_max_num_sequences,
    validate_seq_slot_pool_covers_admission,
)
from shared.engine.sampling.sampling_params import SamplingParams


def req(rid: str, n: int = 5, state: LlmRequestState = LlmRequestState.CONTEXT_INIT) -> LlmRequest:
    return LlmRequest(rid, list(range(n)), SamplingParams(max_tokens=4), state=state)


def test_slot_manager_basics() -> None:
    sm = SlotManager(2)
    assert sm.add_slot("a") == 0
    assert sm.add_slot("b") == 1
    with pytest.raises(NoFreeSlotsError):
        sm.add_slot("c")
    assert issubclass(NoFreeSlotsError, ValueError)
    with pytest.raises(AssertionError, match="already holds a seat"):
        sm.add_slot("a")
    sm.remove_slot("a")
    assert sm.add_slot("c") == 0
    with pytest.raises(AssertionError, match="seat leak"):
        sm.check_conservation()
    sm.shutdown()
    assert sm.num_free == 2 and not sm.slot_mapping


def test_dummy_add_is_idempotent() -> None:
    sm = SlotManager(2)
    s = sm.add_slot(DUMMY_REQUEST_ID)
    assert sm.add_slot(DUMMY_REQUEST_ID) == s
    assert sm.num_in_use == 1
    sm.shutdown()


def test_seq_slot_manager_skips_disagg_generation_init() -> None:
    ssm = SeqSlotManager(4)
    waiting = req("w", state=LlmRequestState.DISAGG_GENERATION_INIT)
    done = req("d", state=LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE)
    ctx = req("c")
    ssm.prepare_resources([waiting, done, ctx])
    assert waiting.seq_slot is None
    assert done.seq_slot == 0 and ctx.seq_slot == 1
    assert done.first_scheduled_time is not None
    ssm.prepare_resources([done])  # already seated: no second add
    assert ssm.num_in_use == 2
    ssm.free_resources(done)
    ssm.free_resources(ctx)
    assert done.seq_slot is None
    ssm.shutdown()


class Recorder(BaseResourceManager):
    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def get_max_resource_count(self) -> int:
        return 1

    def get_needed_resource_to_completion(self, request: LlmRequest) -> int:
        return 0

    def prepare_resources(self, batch: object) -> None:
        self.log.append(f"prepare:{self.name}")

    def free_resources(self, request: LlmRequest) -> None:
        self.log.append(f"free:{self.name}")


def test_resource_manager_order_kv_last_and_reverse_free() -> None:
    log: list[str] = []
    rm = ResourceManager(
        {
            ResourceManagerType.KV_CACHE_MANAGER: Recorder("kv", log),
            ResourceManagerType.SEQ_SLOT_MANAGER: Recorder("seat", log),
        }
    )
    assert list(rm.managers) == [
        ResourceManagerType.SEQ_SLOT_MANAGER,
        ResourceManagerType.KV_CACHE_MANAGER,
    ]
    rm.prepare_resources([])
    rm.free_resources(req("x"))
    assert log == ["prepare:seat", "prepare:kv", "free:kv", "free:seat"]


def test_kv_manager_block_tables_and_needed_to_completion() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, max_num_sequences=2)
    r = req("a", n=6)  # max total tokens = 6 + 4 - 1 = 9 -> 3 blocks
    assert kv.get_needed_resource_to_completion(r) == 3
    kv.scheduled_tokens = {"a": 6}
    kv.prepare_resources([r])
    assert kv.block_table("a") == [0, 1]
    assert kv.get_needed_resource_to_completion(r) == 1
    kv.free_resources(r)
    kv.check_conservation()


def test_compute_max_num_sequences() -> None:
    assert compute_max_num_sequences(8) == 8
    assert compute_max_num_sequences(8, overlap_scheduler=True) == 16
    assert compute_max_num_sequences(8, overlap_scheduler=True, overlap_headroom=False) == 8
    assert compute_max_num_sequences(8, pp_size=4, overlap_scheduler=True) == 32


def test_validate_seq_slot_pool_covers_admission() -> None:
    validate_seq_slot_pool_covers_admission(4, KVCacheManager(16, 4, 4))
    with pytest.raises(ValueError, match="block-table row"):
        validate_seq_slot_pool_covers_admission(8, KVCacheManager(16, 4, 4))
    with pytest.raises(ValueError, match="at least one block"):
        validate_seq_slot_pool_covers_admission(4, KVCacheManager(2, 4, 4))
