"""The admission queue: the pure FIFO class, then the decode-side admission on a real engine."""

from __future__ import annotations

import time

import pytest

from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore, RequestRejected, ResourcesExhausted
from shared.engine.requests.request import FinishReason, LlmRequestState
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.scheduling.admission_queue import AdmissionQueue, QueueEntry, QueueFull
from shared.engine.scheduling.transfer_admission import AdmissionClosed, TransferGrant

S = LlmRequestState


# ------------------------------------------------------------------------ the pure queue
def test_fifo_nothing_passes_the_head() -> None:
    q: AdmissionQueue[int] = AdmissionQueue(max_queued=10)
    for i, need in enumerate([3, 5, 1, 1]):
        q.push(f"r{i}", need, now=float(i))
    free = 4

    def fits(e: QueueEntry[int]) -> bool:
        nonlocal free
        if e.item > free:
            return False
        free -= e.item
        return True

    # r0 (3) fits; r1 (5) does not, and r2/r3 (1 each) would, but must not pass it
    assert [e.key for e in q.admit(fits, now=10.0)] == ["r0"]
    assert q.keys() == ["r1", "r2", "r3"] and free == 1
    free = 7
    assert [e.key for e in q.admit(fits, now=11.0)] == ["r1", "r2", "r3"]
    assert len(q) == 0


def test_bound_refuses_with_retry_hint_and_preempted_go_to_the_front() -> None:
    q: AdmissionQueue[None] = AdmissionQueue(max_queued=2)
    q.push("a", None, now=0.0)
    q.push("b", None, now=0.0)
    with pytest.raises(QueueFull, match="max_queued 2") as err:
        q.push("c", None, now=0.0)
    assert err.value.retry_after_s >= 1
    assert "c" not in q
    q.push_front("p", None, now=1.0)  # a preempted request: past the bound, at the head
    assert q.keys() == ["p", "a", "b"]


def test_retry_hint_follows_the_drain_rate() -> None:
    q: AdmissionQueue[None] = AdmissionQueue(max_queued=20)
    for i in range(20):
        q.push(f"r{i}", None, now=0.0)
    # admit 10 over 10 s: 1 request/s, 10 left -> about 10 s
    for t in range(10):
        q.admit(lambda e, t=t: e.key == f"r{t}", now=float(t + 1))
    assert len(q) == 10
    assert q.retry_after(now=10.0) == pytest.approx(10, abs=2)
    assert AdmissionQueue(5).retry_after(now=0.0) == 1  # nothing measured yet


def test_cancel_and_deadlines_leave_the_rest_in_order() -> None:
    q: AdmissionQueue[None] = AdmissionQueue(max_queued=10)
    q.push("a", None, now=0.0, deadline=5.0)
    q.push("b", None, now=0.0)
    q.push("c", None, now=0.0, deadline=1.0)
    q.push("d", None, now=0.0, deadline=9.0)
    assert q.remove("b") is not None and q.remove("b") is None
    assert [e.key for e in q.pop_expired(now=5.0)] == ["a", "c"]
    assert q.keys() == ["d"]


# ------------------------------------------------------------- decode-side admission, real engine
def engine(blocks: int, max_admitted: int | None = None, max_queued: int = 8) -> EngineCore:
    core = EngineCore(
        EngineConfig(model="tiny", num_kv_blocks=blocks, block_size=16, max_batch_size=4),
        role=DecodeSettings(),
    )
    core.role.admission.configure(max_queued, max_admitted)
    return core


def collect(core: EngineCore) -> list[tuple[str, TransferGrant | None]]:
    got: list[tuple[str, TransferGrant | None]] = []
    core.role.admission.on_admission = lambda rid, grant: got.append((rid, grant))
    return got


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def test_queued_requests_hold_nothing_and_are_admitted_fifo_as_blocks_free() -> None:
    core = engine(blocks=8)
    got = collect(core)
    a = core.role.admission.enqueue(list(range(3, 83)), greedy(4), "a")  # 80 tok: 6 blocks
    b = core.role.admission.enqueue(list(range(3, 53)), greedy(4), "b")  # 50 tok: 4 blocks
    c = core.role.admission.enqueue([5, 6], greedy(2), "c")  # fits, but must not pass b
    assert [rid for rid, _ in got] == ["a"]
    assert got[0][1] is not None and len(got[0][1].blocks) == 5  # prompt blocks, pinned
    assert a.state == S.DISAGG_GENERATION_TRANS_IN_PROGRESS
    for r in (b, c):
        assert r.state == S.QUEUED and r.seq_slot is None
        assert r.request_id not in core.kv_manager.block_tables
    assert core.kv_manager.num_free_blocks == 3
    core.abort("a")  # its blocks go back: b and then c are admitted, in order
    core.admit_queued()
    assert [rid for rid, _ in got] == ["a", "b", "c"]
    assert got[1][1] is not None and got[1][1].queue_seconds >= 0.0
    for rid in ("b", "c"):
        core.abort(rid)
    core.check_conservation()


def test_never_fits_is_refused_at_once_and_full_queue_is_resource_exhausted() -> None:
    core = engine(blocks=4, max_queued=1)
    collect(core)
    # within the context the 4-block pool serves, but 3 completions need 4 + 2 x 2 blocks
    huge = SamplingParams(max_tokens=20, ignore_eos=True, n=3)
    with pytest.raises(RequestRejected, match="could never be served"):
        core.role.admission.enqueue(list(range(3, 43)), huge, "huge")
    core.role.admission.enqueue(list(range(3, 50)), greedy(2), "a")  # 3 blocks (+1 token)
    core.role.admission.enqueue(list(range(3, 50)), greedy(2), "b")  # queued
    with pytest.raises(ResourcesExhausted, match="admission queue is full") as err:
        core.role.admission.enqueue([5, 6, 7], greedy(2), "c")
    assert err.value.retry_after_s >= 1
    assert "c" not in core.requests and [r for r in core.recent_history if r[0] == "c"]
    for rid in ("a", "b"):
        core.abort(rid)
    core.check_conservation()


def test_max_admitted_bounds_requests_past_the_queue() -> None:
    core = engine(blocks=64, max_admitted=2)
    got = collect(core)
    for i in range(4):
        core.role.admission.enqueue([5, 6, 7 + i], greedy(2), f"r{i}")
    assert [rid for rid, _ in got] == ["r0", "r1"]
    assert core.requests["r2"].state == S.QUEUED
    core.abort("r0")
    core.admit_queued()
    assert [rid for rid, _ in got] == ["r0", "r1", "r2"]
    for rid in ("r1", "r2", "r3"):
        core.abort(rid)
    core.check_conservation()


def test_deadline_in_the_queue_and_drain() -> None:
    core = engine(blocks=4)
    got = collect(core)
    core.role.admission.enqueue(list(range(3, 50)), greedy(2), "a")
    b = core.role.admission.enqueue(list(range(3, 50)), greedy(2), "b", time.monotonic() + 0.01)
    core.role.admission.enqueue(list(range(3, 43)), greedy(2), "c")
    time.sleep(0.02)
    core.admit_queued()
    assert ("b", None) in got and "b" not in core.requests  # expired: reported, nothing held
    assert b.finish_reason == FinishReason.ABORTED and b.history[-2][0] == S.QUEUED
    assert core.role.admission.drain() == ["c"]
    assert "c" not in core.requests
    with pytest.raises(AdmissionClosed):  # a request racing the shutdown is not queued
        core.role.admission.enqueue([5, 6], greedy(2), "late")
    core.abort("a")
    core.check_conservation()


def test_a_local_request_waiting_to_start_leaves_room_for_transfers_not_a_refusal() -> None:
    """A local prefill added but not yet scheduled is QUEUED in the scheduler: a transfer that
    fits beside the blocks it will take is admitted at once (even with no queue at all); one
    that would take those blocks waits instead (so the local request is not starved)."""
    core = engine(blocks=8, max_queued=0)
    got = collect(core)
    core.add_request(list(range(3, 53)), greedy(2), "local")  # 50 tok + 1: 4 blocks, waiting
    core.role.admission.enqueue([5, 6, 7], greedy(2), "fits")  # 1 block: 4 + 1 <= 8
    assert [rid for rid, _ in got] == ["fits"]
    with pytest.raises(ResourcesExhausted, match="admission queue is full"):
        core.role.admission.enqueue(list(range(3, 53)), greedy(2), "takes")  # 4 + 1 + 4 > 8
    for rid in ("local", "fits"):
        core.abort(rid)
    core.check_conservation()
