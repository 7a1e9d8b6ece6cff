"""Scheduler + seat/KV bookkeeping driven without a model (the engine tests add the model)."""

from __future__ import annotations

from shared.engine.connector.base import NoKvConnector
from shared.engine.requests.request import LlmRequest, LlmRequestState
from shared.engine.resources.resource_manager import (
    KVCacheManager,
    ResourceManager,
    ResourceManagerType,
    SeqSlotManager,
)
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from shared.engine.scheduling.slo import Ewma, SloPolicy


class Harness:
    def __init__(self, blocks: int, block_size: int, batch: int, budget: int):
        self.kv = KVCacheManager(blocks, block_size, batch)
        self.seats = SeqSlotManager(batch)
        self.rm = ResourceManager(
            {
                ResourceManagerType.KV_CACHE_MANAGER: self.kv,
                ResourceManagerType.SEQ_SLOT_MANAGER: self.seats,
            }
        )
        self.sched = Scheduler(
            SchedulerConfig(batch, budget),
            self.kv,
            self.seats,
            self.rm.free_resources,
            connector=NoKvConnector(),
        )
        self.finished: list[LlmRequest] = []

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> LlmRequest:
        r = LlmRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.sched.add_request(r)
        return r

    def step(self) -> list[tuple[str, int]]:
        out = self.sched.schedule()
        batch = [s.request for s in out.scheduled]
        self.rm.prepare_resources(batch)
        for r in batch:
            assert r.seq_slot is not None
        sampled = [s.request for s in out.scheduled if s.completes_context]
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        self.rm.update_resources(batch)
        for r in sampled:
            if r.state == LlmRequestState.CONTEXT_INIT:
                r.transition(LlmRequestState.GENERATION_IN_PROGRESS)
            r.output_token_ids.append(7)
            if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                self.sched.remove(r)
                self.rm.free_resources(r)
                r.transition(LlmRequestState.GENERATION_COMPLETE)
                self.finished.append(r)
        self.kv.blocks.check_integrity()
        return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]

    def run(self, limit: int = 1000) -> None:
        for _ in range(limit):
            if not self.sched.has_work:
                return
            self.step()
        raise AssertionError("scheduler did not drain")


def test_chunked_prefill_under_token_budget_then_decode() -> None:
    h = Harness(blocks=64, block_size=4, batch=4, budget=8)
    h.add("a", list(range(20)), 3)
    assert h.step() == [("a", 8)]
    assert h.step() == [("a", 8)]
    h.add("b", list(range(100, 103)), 2)
    assert h.step() == [("a", 4), ("b", 3)]  # a's last chunk, then b fits the rest
    assert h.step() == [("a", 1), ("b", 1)]
    h.run()
    assert [r.request_id for r in h.finished] == ["b", "a"]
    h.rm.shutdown()


def test_batch_and_seat_limits() -> None:
    h = Harness(blocks=64, block_size=4, batch=2, budget=100)
    for i in range(3):
        h.add(f"r{i}", [i, i + 1], 2)
    assert [rid for rid, _ in h.step()] == ["r0", "r1"]
    assert h.seats.num_free == 0
    h.run()
    assert len(h.finished) == 3
    h.rm.shutdown()


def test_preempts_newest_by_full_release_and_recomputes() -> None:
    # 6 blocks of 2 tokens: two requests of 4 prompt tokens growing by 4 cannot both finish
    h = Harness(blocks=6, block_size=2, batch=4, budget=64)
    a = h.add("a", [1, 2, 3, 4], 5)
    b = h.add("b", [5, 6, 7, 8], 5)
    h.run()
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert {r.request_id for r in h.finished} == {"a", "b"}
    states = [s for s, _ in b.history[1:]]
    # back to the queue holding nothing, then admitted again for recompute
    i = states.index(LlmRequestState.QUEUED)
    assert states[i + 1] == LlmRequestState.CONTEXT_INIT
    h.rm.shutdown()  # asserts seat and block conservation


def test_prefix_cache_hit_skips_computed_blocks() -> None:
    h = Harness(blocks=32, block_size=4, batch=4, budget=64)
    shared = list(range(12))
    h.add("a", [*shared, 50, 51], 1)
    h.run()
    b = h.add("b", [*shared, 60], 1)
    assert h.step() == [("b", 1)]  # 12 cached tokens, only the last one computed
    assert b.cached_tokens == 12
    h.rm.shutdown()


def test_whole_prompt_cached_still_computes_last_token() -> None:
    h = Harness(blocks=32, block_size=4, batch=4, budget=64)
    h.add("a", list(range(8)), 1)
    h.run()
    h.add("b", list(range(8)), 1)
    assert h.step() == [("b", 4)]  # last block recomputed: its final token needs logits
    h.rm.shutdown()


def test_admits_with_blocks_for_context_and_first_token_only() -> None:
    # 4 blocks of 4: a needs all 4 to completion (8 + 7 tokens) but 3 to start (8 + 1), so b
    # (3 tokens + 1: one block) starts beside it; a reservation to completion would hold b back
    h = Harness(blocks=4, block_size=4, batch=4, budget=64)
    a = h.add("a", list(range(8)), 8)
    b = h.add("b", [1, 2, 3], 4)
    assert h.step() == [("a", 8), ("b", 3)]
    h.run()  # they grow into each other: b (the newest) is preempted, both finish
    assert {r.request_id for r in h.finished} == {"a", "b"}
    assert a.num_preemptions == 0 and len(b.output_token_ids) == 4
    h.rm.shutdown()


def test_itl_hold_keeps_new_prompts_out_of_a_slow_batch_until_it_drains() -> None:
    """The decode role's hold (its SloPolicy's ITL bound, measured 80 ms at batch 2 against a
    50 ms target): b and c (FCFS behind b) wait, holding nothing, while a decodes; they
    start once a is done, one at a time while the bound binds; every block and seat comes back."""
    slo = SloPolicy(itl_slo_ms=50)
    slo.steps.by_batch[2] = Ewma()
    slo.steps.by_batch[2].update(0.08)
    h = Harness(blocks=64, block_size=4, batch=4, budget=64)
    h.sched.hold = lambda request, batch: slo.batch_too_slow(batch, request)
    a = h.add("a", [1, 2, 3], 4)
    assert h.step() == [("a", 3)]  # alone: never held
    b, c = h.add("b", [4, 5], 2), h.add("c", [6], 2)
    while a.state != LlmRequestState.GENERATION_COMPLETE:
        assert [rid for rid, _ in h.step()] == ["a"]
        assert list(h.sched.waiting) == [b, c]
        assert "b" not in h.kv.block_tables and b.seq_slot is None
    assert [rid for rid, _ in h.step()] == ["b"]
    h.run()
    assert [r.request_id for r in h.finished] == ["a", "b", "c"]
    slo.itl_slo_ms = None  # no target: nothing is held
    for rid in ("d", "e"):
        h.add(rid, [7, 8], 2)
    assert [rid for rid, _ in h.step()] == ["d", "e"]
    h.run()
    assert h.kv.num_free_blocks == 64 and h.seats.num_free == 4
    h.rm.shutdown()
