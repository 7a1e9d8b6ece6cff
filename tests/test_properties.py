"""Stateful property test of the seat system, the block manager and the scheduler.

A hypothesis `RuleBasedStateMachine` drives two real `EngineCore`s through random interleavings of
the request lifecycle (docs/seat-system.md §3-§8):

- `dec`, a colocated / decode-side engine: colocated requests, decode-side P/D requests
  (`reserve_for_transfer` -> `land_part` -> `complete_transfer` / `fail_transfer`), aborts in
  every state, steps with chunked prefill, prefix-cache hits and preemption (small pools);
- `pre`, a prefill-side engine (`PrefillRole`): prefill, `accept_token` (pin + seat
  back), `complete_context` (unpin) ok / failed, aborts in every state.

Only the model is faked, and only its forward: it returns logits whose argmax is the token the
machine chose for that row, and it "writes K/V" into a shadow of the pool through the batch's own
`slot_mapping`: each slot records the token prefix whose K/V it holds. The decode-side transfer
writes the shadow the same way into the blocks `reserve_for_transfer` returned. Every piece of
bookkeeping (scheduler, KVCacheManager, BlockManager, SeqSlotManager, Sampler, OutputProcessor,
state machine) is the real one, driven by the real `EngineCore` methods.

After every rule the invariants are checked (`check_engine`); at teardown everything is aborted
and full conservation is asserted. `drain_decode` / `drain_prefill` also check liveness. The
machine found a head-of-line deadlock and a non-atomic `complete_transfer`; both are fixed and
kept as regression tests at the end of this file.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from shared.cdiv import cdiv
from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore, RequestRejected, ResourcesExhausted
from shared.engine.requests.request import (
    ALLOWED_TRANSITIONS,
    FinishReason,
    LlmRequest,
    LlmRequestState,
)
from shared.engine.resources.block_manager import compute_block_hashes
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.roles.prefill_role import PrefillSettings
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.forward_batch import ForwardBatch
from shared.model.loader import LoadedModel, tiny_config
from shared.model.tokenizer import ByteTokenizer
from tests.pd_steps import reserve_now

S = LlmRequestState
EOS = 257
VOCAB = 259
# Three fixed "system prompts": requests start with a random-length slice of one of them, so the
# prefix cache hits (whole blocks, partial blocks, and divergence mid-block).
PREFIXES = (
    [10 + i for i in range(24)],
    [10 + i for i in range(8)] + [90 + i for i in range(16)],  # shares 8 tokens with the first
    [200 + (i % 3) for i in range(24)],
)
# a live request in one of these states must not hold a seat (running CONTEXT_INIT may)
NO_SEAT_STATES = frozenset(s for s in S if s not in (S.CONTEXT_INIT, S.GENERATION_IN_PROGRESS))

SETTINGS = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,  # deterministic in CI
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# ----------------------------------------------------------------------------- the fake model
class ShadowModel:
    """Forward only. Returns `[num_seqs, vocab]` logits whose argmax is the machine's choice for
    that row, and records in `shadow[slot]` the token prefix whose K/V that slot now holds."""

    lora = None  # no adapter slots (shared/model/causal_lm.py)

    def lora_names(self) -> frozenset[str]:
        return frozenset()

    def __init__(self) -> None:
        self.shadow: dict[int, tuple[int, ...]] = {}
        self.scheduled: list = []  # captured through the role's layer hook
        self.next_tokens: list[int] = []

    def capture(self, scheduled):
        self.scheduled = list(scheduled)
        return None  # no per-layer hook

    def forward(self, batch: ForwardBatch, kv_pool: torch.Tensor, layer_hook=None):
        assert batch.num_seqs == len(self.scheduled)
        ids = batch.input_ids.tolist()
        pos = batch.positions.tolist()
        slots = batch.slot_mapping.tolist()
        t = 0
        for s, qlen in zip(self.scheduled, batch.query_lens, strict=True):
            r = s.request
            tokens = r.all_token_ids
            assert qlen == s.num_new_tokens >= 1, f"{r.request_id} scheduled with no new token"
            for j in range(qlen):
                p = pos[t]
                assert p == r.num_computed_tokens + j, (r.request_id, p)
                assert ids[t] == tokens[p]
                self.shadow[slots[t]] = tuple(tokens[: p + 1])
                t += 1
        logits = torch.zeros(batch.num_seqs, VOCAB)
        for i in range(batch.num_seqs):
            tok = self.next_tokens[i] if i < len(self.next_tokens) else 65
            logits[i, tok] = 1.0
        return logits


def make_engine(bs: int, blocks: int, batch: int, budget: int, caching: bool, context_only: bool):
    model = ShadowModel()
    loaded = LoadedModel(
        model=model,  # type: ignore[arg-type]
        config=tiny_config(),
        tokenizer=ByteTokenizer(),
        name="shadow",
        eos_token_ids=frozenset({EOS}),
    )
    config = EngineConfig(
        model="shadow",
        block_size=bs,
        num_kv_blocks=blocks,
        max_batch_size=batch,
        max_num_tokens=budget,
        enable_prefix_caching=caching,
        device="cpu",
        dtype="float32",
    )
    if context_only:
        core = EngineCore(config, loaded, role=PrefillSettings(lambda s, kv: model.capture(s)))
    else:
        core = EngineCore(config, loaded, role=DecodeSettings())
        core.connector.layer_hook = model.capture  # type: ignore[method-assign]  # the fake's input
    return core, model


# ----------------------------------------------------------------------------- the invariants
def _queued(core: EngineCore) -> set[str]:
    """Requests waiting in a decode engine's admission queue (a prefill engine has none)."""
    return set() if core.context_only else set(core.role.admission.queue.keys())


def check_engine(core: EngineCore, model: ShadowModel, tracked: list[LlmRequest], pins: dict):
    """Everything that must hold between two engine calls. `pins[rid]` is what the test expects
    the request to have pinned (decode: the reserved blocks; prefill: the table at finish)."""
    kv = core.kv_manager
    bm = kv.blocks
    bs = kv.block_size
    seats = core.seq_slot_manager.slot_manager
    sched = core.scheduler
    live = core.requests
    bm.check_integrity()

    # -- requests and the scheduler
    running, waiting = sched.running, list(sched.waiting)
    assert len(set(map(id, running))) == len(running), "request twice in running"
    assert len(set(map(id, waiting))) == len(waiting), "request twice in waiting"
    assert not set(map(id, running)) & set(map(id, waiting)), "request both running and waiting"
    assert len(running) <= sched.config.max_batch_size
    in_sched = {r.request_id for r in running} | {r.request_id for r in waiting}
    for r in running + waiting:
        assert live.get(r.request_id) is r, f"{r.request_id} scheduled but not live"
    for rid, r in live.items():
        assert r.request_id == rid and not r.is_finished, (rid, r.state)
        if r.state in (S.DISAGG_GENERATION_INIT, S.DISAGG_GENERATION_TRANS_IN_PROGRESS):
            assert rid not in in_sched, f"{rid} schedulable before its KV arrived"
        elif r.state == S.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
            assert rid not in in_sched, f"{rid} still scheduled while its KV is pushed"
        elif rid in _queued(core):
            assert r.state == S.QUEUED and rid not in in_sched, (rid, r.state)
        else:
            assert rid in in_sched, f"{rid} ({r.state.name}) is live but lost by the scheduler"
        assert len(r.output_token_ids) <= r.sampling_params.max_tokens

    # -- seats: bijection between slot_mapping and requests holding seq_slot
    holders = {rid: r.seq_slot for rid, r in live.items() if r.seq_slot is not None}
    assert seats.slot_mapping == holders, (seats.slot_mapping, holders)
    assert len(set(holders.values())) == len(holders), f"two requests share a seat: {holders}"
    assert not set(holders.values()) & seats.free_slots, "a held seat is also free"
    assert set(holders.values()) | seats.free_slots == set(range(seats.max_num_requests))
    assert core.seq_slot_manager.num_in_use == len(holders)
    for r in running:
        assert r.seq_slot is not None, f"running {r.request_id} has no seat"
    for r in waiting:
        assert r.seq_slot is None, f"waiting {r.request_id} holds seat {r.seq_slot}"
    for rid, r in live.items():
        if r.state in NO_SEAT_STATES:
            assert r.seq_slot is None, f"{rid} in {r.state.name} holds seat {r.seq_slot}"
    for seat, owner in enumerate(core.sampler.owner):
        if owner is not None:
            assert holders.get(owner) == seat, f"sampler row {seat} owned by {owner}, not seated"
    for r in tracked:
        if r.request_id not in live:
            assert r.seq_slot is None, f"ended {r.request_id} kept seat {r.seq_slot}"

    # -- state machine: every recorded move is allowed; seats only in GENERATION_IN_PROGRESS
    for r in tracked:
        assert r.history[0][0] in (S.QUEUED, S.DISAGG_GENERATION_INIT)
        for (a, _), (b, _) in zip(r.history, r.history[1:], strict=False):
            assert b in ALLOWED_TRANSITIONS[a], f"{r.request_id}: {a.name} -> {b.name}"
        for state, seat in r.history:
            if state == S.GENERATION_IN_PROGRESS:
                assert seat is not None, f"{r.request_id} entered GENERATION without a seat"
            else:
                assert seat is None, f"{r.request_id} entered {state.name} holding seat {seat}"

    # -- block tables, references, pins
    assert set(kv.block_tables) <= set(live), f"tables of dead requests: {set(kv.block_tables)}"
    assert set(kv.pinned) == set(pins), (sorted(kv.pinned), sorted(pins))
    occurrences: Counter[int] = Counter()
    where: dict[int, set[int]] = {}
    for rid, table in kv.block_tables.items():
        assert len(set(table)) == len(table), f"{rid}'s table repeats a block: {table}"
        for i, b in enumerate(table):
            occurrences[b] += 1
            where.setdefault(b, set()).add(i)
            assert bm.ref_count(b) >= 1, f"{rid} holds block {b} with ref 0"
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == occurrences[b], (
            f"block {b}: ref {bm.ref_count(b)} but {occurrences[b]} tables hold it"
        )
        if occurrences[b] > 1:
            assert b in bm._hash_of, f"block {b} shared by {occurrences[b]} tables but not cached"
            assert len(where[b]) == 1, f"shared block {b} at different indices {where[b]}"
    pin_count: Counter[int] = Counter()
    for rid, blocks in kv.pinned.items():
        assert blocks == pins[rid], (rid, blocks, pins[rid])
        pin_count.update(blocks)
    for b in range(bm.num_blocks):
        assert bm._pins[b] == pin_count[b], f"block {b}: {bm._pins[b]} pins, {pin_count[b]} owners"
        if pin_count[b]:
            assert b not in bm._free and b not in bm._evictable, f"pinned block {b} is pooled"

    # -- each live request's blocks cover its tokens, and hold the right K/V
    for rid, r in live.items():
        table = kv.block_tables.get(rid)
        if r.state in (S.DISAGG_GENERATION_INIT, S.DISAGG_GENERATION_TRANS_IN_PROGRESS):
            assert table is not None and len(table) == cdiv(r.prompt_len, bs)
            first = len(table) - len(pins[rid])
            assert table[first:] == pins[rid], f"{rid}: pinned blocks are not its tail"
            for b in pins[rid]:
                assert occurrences[b] == 1 and b not in bm._hash_of, f"transfer block {b} shared"
            assert_content(model, table, r.all_token_ids, first * bs, bs, rid)  # the prefix hit
        elif r.state == S.DISAGG_CONTEXT_TRANS_IN_PROGRESS:
            assert table is None, f"{rid} pushing its KV but still holds a table"
            assert r.num_computed_tokens == r.prompt_len
            assert len(pins[rid]) == cdiv(r.prompt_len, bs)
            # nobody overwrote the blocks being sent
            assert_content(model, pins[rid], r.all_token_ids, r.prompt_len, bs, rid)
        elif rid in _queued(core):
            assert table is None and r.seq_slot is None, f"queued {rid} holds {table}"
            assert rid not in kv.pinned, f"queued {rid} pins blocks"
        elif any(r is w for w in waiting):
            if r.state == S.DISAGG_GENERATION_TRANS_COMPLETE:
                assert table is not None and len(table) == cdiv(r.prompt_len, bs)
                assert r.num_computed_tokens == r.prompt_len
                assert_content(model, table, r.all_token_ids, r.prompt_len, bs, rid)
            else:
                assert table is None, f"waiting {rid} ({r.state.name}) holds blocks {table}"
                assert r.num_computed_tokens == 0
        else:  # running
            assert table is not None
            assert len(table) == cdiv(r.num_computed_tokens, bs), (
                f"{rid}: {len(table)} blocks for {r.num_computed_tokens} computed tokens"
            )
            assert r.num_computed_tokens <= r.num_tokens
            assert_content(model, table, r.all_token_ids, r.num_computed_tokens, bs, rid)
    # every block published in the prefix cache holds exactly the prefix its hash names
    for b, h in bm._hash_of.items():
        content = [model.shadow.get(b * bs + off) for off in range(bs)]
        assert all(c is not None for c in content), f"cached block {b} was never written"
        full = content[-1]
        assert len(full) % bs == 0 and compute_block_hashes(list(full), bs)[-1] == h, (
            f"cached block {b} holds K/V of another prefix"
        )
        for off, c in enumerate(content):
            assert c == full[: len(full) - bs + off + 1], f"cached block {b} slot {off} torn"


def assert_content(model, table, tokens, upto, bs, rid) -> None:
    for p in range(upto):
        got = model.shadow.get(table[p // bs] * bs + p % bs)
        if got != tuple(tokens[: p + 1]):
            raise AssertionError(
                f"{rid}: position {p} in block {table[p // bs]} holds K/V of "
                f"{None if got is None else got[-8:]}, "
                f"expected {tuple(tokens[max(0, p - 7) : p + 1])}"
            )


# ----------------------------------------------------------------------------- the machine
prompts = st.builds(
    lambda which, n, tail: (PREFIXES[which][:n] + tail) or [3],
    st.integers(0, len(PREFIXES) - 1),
    st.integers(0, 20),
    st.lists(st.sampled_from([3, 4, 5]), max_size=6),
)
token_choices = st.lists(st.sampled_from([65, 65, 66, 67, EOS]), max_size=6)


class PdMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dec: EngineCore | None = None
        self.n = 0
        self.tracked: dict[str, list[LlmRequest]] = {"dec": [], "pre": []}
        self.dec_pins: dict[str, list[int]] = {}  # blocks reserved for each transfer
        self.dec_first: dict[str, int] = {}
        self.pre_pins: dict[str, list[int]] = {}  # table at finish of each pushed prefill

    # -- set-up: a small pool so preemption, eviction and ResourcesExhausted all happen
    @initialize(
        bs=st.sampled_from([1, 2, 4]),
        blocks=st.integers(4, 20),
        batch=st.integers(1, 4),
        budget=st.integers(1, 24),
        caching=st.booleans(),
    )
    def setup(self, bs, blocks, batch, budget, caching) -> None:
        blocks = max(blocks, batch)  # validate_seq_slot_pool_covers_admission
        self.bs = bs
        self.dec, self.dec_model = make_engine(bs, blocks, batch, budget, caching, False)
        self.pre, self.pre_model = make_engine(bs, blocks, batch, budget, caching, True)
        self.dec.role.admission.configure(max_queued=4, max_admitted=3)
        self.dec.role.admission.on_admission = self._on_grant

    def _on_grant(self, rid: str, grant) -> None:
        """The decode node's admission callback: the request now holds pinned blocks."""
        assert grant is not None  # no deadlines in this machine
        assert grant.request.state == S.DISAGG_GENERATION_TRANS_IN_PROGRESS
        assert self.dec.kv_manager.block_table(rid)[grant.first_block :] == grant.blocks
        event("queue: admitted")
        self.dec_pins[rid] = list(grant.blocks)
        self.dec_first[rid] = grant.first_block
        self._land(rid, 0.5)

    def _rid(self) -> str:
        self.n += 1
        return f"r{self.n}"

    def _fits(self, core: EngineCore, prompt: list[int], max_tokens: int) -> bool:
        if len(prompt) + max_tokens > core.max_model_len:  # the context the pool serves
            return False
        tokens = len(prompt) + (0 if core.context_only else max_tokens - 1)  # prefill: prompt only
        return cdiv(tokens, self.bs) <= core.kv_manager.blocks.num_blocks

    def _in(self, core: EngineCore, *states: LlmRequestState) -> list[str]:
        return sorted(rid for rid, r in core.requests.items() if r.state in states)

    # -- admission
    @rule(prompt=prompts, max_tokens=st.integers(1, 8), ignore_eos=st.booleans())
    def add_colocated(self, prompt, max_tokens, ignore_eos) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        if not self._fits(self.dec, prompt, max_tokens):
            with pytest.raises(RequestRejected):
                self.dec.add_request(prompt, params, self._rid())
            return
        self.tracked["dec"].append(self.dec.add_request(prompt, params, self._rid()))

    @rule(prompt=prompts, max_tokens=st.integers(1, 8), ignore_eos=st.booleans())
    def reserve_for_transfer(self, prompt, max_tokens, ignore_eos) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        rid = self._rid()
        if not self._fits(self.dec, prompt, max_tokens):
            with pytest.raises(RequestRejected):
                reserve_now(self.dec, prompt, params, rid)
            return
        free_before = self.dec.kv_manager.num_free_blocks
        try:
            request, blocks, first = reserve_now(self.dec, prompt, params, rid)
        except ResourcesExhausted:
            event("reserve: ResourcesExhausted")
            assert rid not in self.dec.requests and rid not in self.dec.kv_manager.block_tables
            assert self.dec.kv_manager.num_free_blocks == free_before
            return
        assert request.state == S.DISAGG_GENERATION_TRANS_IN_PROGRESS and request.seq_slot is None
        event(f"reserve: prefix hit {bool(first)}")
        assert request.cached_tokens == first * self.bs
        assert self.dec.kv_manager.block_table(rid)[first:] == blocks
        self.tracked["dec"].append(request)
        self.dec_pins[rid] = list(blocks)
        self.dec_first[rid] = first

    @rule(prompt=prompts, max_tokens=st.integers(1, 8), ignore_eos=st.booleans())
    def queue_for_transfer(self, prompt, max_tokens, ignore_eos) -> None:
        """A Generate through the admission queue: admitted at once (blocks reserved, pinned,
        transfer started) or QUEUED holding nothing until a step or command frees blocks."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        rid = self._rid()
        if not self._fits(self.dec, prompt, max_tokens):
            with pytest.raises(RequestRejected):
                self.dec.role.admission.enqueue(prompt, params, rid)
            return
        try:
            request = self.dec.role.admission.enqueue(prompt, params, rid)
        except ResourcesExhausted:
            event("queue: full")
            assert rid not in self.dec.requests and rid not in self.dec.kv_manager.block_tables
            return
        self.tracked["dec"].append(request)
        if request.state == S.QUEUED:
            event("queue: waits")

    @rule(prompt=prompts, max_tokens=st.integers(1, 8))
    def add_prefill(self, prompt, max_tokens) -> None:
        params = SamplingParams(max_tokens=max_tokens)
        if not self._fits(self.pre, prompt, max_tokens):
            with pytest.raises(RequestRejected):
                self.pre.add_request(prompt, params, self._rid())
            return
        self.tracked["pre"].append(self.pre.add_request(prompt, params, self._rid()))

    # -- the decode-side transfer
    def _land(self, rid: str, fraction: float) -> None:
        """The transfer writes (part of) the prompt's K/V into the reserved blocks."""
        r = self.dec.requests[rid]
        first, blocks = self.dec_first[rid], self.dec_pins[rid]
        start = first * self.bs
        end = start + int((r.prompt_len - start) * fraction)
        for p in range(start, end):
            slot = blocks[p // self.bs - first] * self.bs + p % self.bs
            self.dec_model.shadow[slot] = tuple(r.prompt_token_ids[: p + 1])

    @precondition(
        lambda self: self.dec and self._in(self.dec, S.DISAGG_GENERATION_TRANS_IN_PROGRESS)
    )
    @rule(data=st.data())
    def land_part(self, data) -> None:
        """Half the prompt's K/V lands (the pushes of its first layers or chunks)."""
        rid = data.draw(st.sampled_from(self._in(self.dec, S.DISAGG_GENERATION_TRANS_IN_PROGRESS)))
        if rid in self.dec_pins:  # reserved here by hand (the queue's grants are not tracked)
            self._land(rid, 0.5)

    @precondition(
        lambda self: self.dec and self._in(self.dec, S.DISAGG_GENERATION_TRANS_IN_PROGRESS)
    )
    @rule(data=st.data(), first_token=st.sampled_from([65, 66, EOS]))
    def complete_transfer(self, data, first_token) -> None:
        rid = data.draw(st.sampled_from(self._in(self.dec, S.DISAGG_GENERATION_TRANS_IN_PROGRESS)))
        self._land(rid, 1.0)
        request = self.dec.requests[rid]
        del self.dec_pins[rid]
        delta = self.dec.role.complete_transfer(rid, first_token)[0]
        assert request.output_token_ids == [first_token]
        event(f"complete_transfer: finished at once {delta.finish_reason is not None}")
        if delta.finish_reason is None:
            assert request.state == S.DISAGG_GENERATION_TRANS_COMPLETE
            assert request in self.dec.scheduler.waiting and request.seq_slot is None
        else:
            assert rid not in self.dec.requests

    @precondition(lambda self: self.dec and self.dec.requests)
    @rule(data=st.data(), landed=st.floats(0, 1))
    def fail_transfer(self, data, landed) -> None:
        """The decode server's release of a failed stream: mid-transfer, or at any later point."""
        rid = data.draw(st.sampled_from(sorted(self.dec.requests)))
        request = self.dec.requests[rid]
        mid_transfer = request.is_disagg_waiting_for_kv
        if mid_transfer:
            self._land(rid, landed)  # whatever arrived before the failure is garbage now
            del self.dec_pins[rid]
        self.dec.role.fail_transfer(rid)
        assert rid not in self.dec.requests and request.finish_reason == FinishReason.ABORTED
        if mid_transfer or request.history[-2][0] in (S.QUEUED, S.CONTEXT_INIT):
            assert request.state == S.DISAGG_TRANS_ERROR
        else:
            assert request.state == S.GENERATION_COMPLETE

    # -- cancellation, in any state, on either side
    @precondition(lambda self: self.dec is not None)
    @rule(data=st.data(), on_prefill=st.booleans())
    def abort(self, data, on_prefill) -> None:
        core = self.pre if on_prefill else self.dec
        ids = [*sorted(core.requests), "never-admitted"]
        if self.tracked["pre" if on_prefill else "dec"]:  # sometimes an already ended one
            ids.append(self.tracked["pre" if on_prefill else "dec"][0].request_id)
        rid = data.draw(st.sampled_from(ids))
        was_live = rid in core.requests
        out = core.abort(rid)
        assert (out is not None) == was_live
        if out is not None:
            event(f"abort: {core.requests.get(rid, out).history[-2][0].name}")
            assert out.is_finished and out.finish_reason == FinishReason.ABORTED
            assert out.seq_slot is None and rid not in core.kv_manager.block_tables
        (self.pre_pins if on_prefill else self.dec_pins).pop(rid, None)

    # -- steps
    def _step(self, core: EngineCore, model: ShadowModel, tokens: list[int]) -> None:
        before = dict(core.requests)
        pushing = set(self._in(core, S.DISAGG_CONTEXT_TRANS_IN_PROGRESS))
        preemptions = {rid: r.num_preemptions for rid, r in before.items()}
        model.next_tokens = tokens
        deltas = core.step()
        finished = {d.request_id for d in deltas if d.finish_reason is not None}
        if any(r.num_preemptions > preemptions[rid] for rid, r in before.items()):
            event(f"step: preemption (context_only={core.context_only})")
        if any(r.cached_tokens for r in before.values()):
            event(f"step: a live request had a prefix hit (context_only={core.context_only})")
        for d in deltas:
            assert len(d.token_ids) == 1
        for rid, r in before.items():
            if rid in finished:
                assert rid not in core.requests and r.state == S.GENERATION_COMPLETE
                if r.finish_reason == FinishReason.LENGTH:
                    assert len(r.output_token_ids) == r.sampling_params.max_tokens
                else:
                    assert r.output_token_ids[-1] == EOS and not r.sampling_params.ignore_eos
            else:
                assert core.requests.get(rid) is r, f"{rid} vanished without finishing"
        for rid in self._in(core, S.DISAGG_CONTEXT_TRANS_IN_PROGRESS):
            if rid not in pushing:  # finished its context this step: seat gone, table pinned
                assert core.context_only
                r = core.requests[rid]
                assert r.seq_slot is None and len(r.output_token_ids) == 1
                assert rid not in core.kv_manager.block_tables
                self.pre_pins[rid] = list(core.kv_manager.pinned.get(rid, []))
        if not core.context_only:
            assert not self._in(core, S.DISAGG_CONTEXT_TRANS_IN_PROGRESS)

    @precondition(lambda self: self.dec is not None)
    @rule(tokens=token_choices)
    def step_decode(self, tokens) -> None:
        self._step(self.dec, self.dec_model, tokens)

    @precondition(lambda self: self.dec is not None)
    @rule(tokens=token_choices)
    def step_prefill(self, tokens) -> None:
        self._step(self.pre, self.pre_model, tokens)

    def _drain(self, core: EngineCore, model: ShadowModel, tokens: list[int]) -> None:
        """Step until no work, or until a step schedules nothing and preempts nothing (a
        stall), or a cap. A step that only preempts makes progress: it frees blocks for the next
        one, as the engine thread steps again while there is work."""
        for _ in range(1000):
            if not core.has_work:
                return
            steps, preemptions = core.num_steps, core.scheduler.num_preemptions
            self._step(core, model, tokens)
            if core.num_steps == steps and core.scheduler.num_preemptions == preemptions:
                return

    @precondition(lambda self: self.dec is not None)
    @rule(tokens=token_choices)
    def drain_decode(self, tokens) -> None:
        """Liveness: with no transfer in flight (nothing pinned), stepping finishes everything."""
        self.dec.admit_queued()  # what the engine thread runs after every command
        self._drain(self.dec, self.dec_model, tokens)
        in_flight = self._in(
            self.dec, S.DISAGG_GENERATION_INIT, S.DISAGG_GENERATION_TRANS_IN_PROGRESS
        )
        if not in_flight:  # nothing pinned by a transfer: the queue's head must have been let in
            assert not len(self.dec.role.admission), (
                f"admission queue stuck: {self.dec.role.admission.queue.keys()}, "
                f"free blocks={self.dec.kv_manager.num_free_blocks}"
            )
        if not self.dec.has_work:
            return
        if self._in(self.dec, S.DISAGG_GENERATION_INIT, S.DISAGG_GENERATION_TRANS_IN_PROGRESS):
            return  # blocks reserved for transfers may be what the scheduler waits for
        raise AssertionError(
            f"decode engine stuck: running={[r.request_id for r in self.dec.scheduler.running]} "
            f"waiting={[(r.request_id, r.state.name) for r in self.dec.scheduler.waiting]} "
            f"free blocks={self.dec.kv_manager.num_free_blocks}"
        )

    @precondition(lambda self: self.dec is not None)
    @rule(tokens=token_choices)
    def drain_prefill(self, tokens) -> None:
        """Liveness: a prefill engine only stalls on blocks pinned by pushes still in flight."""
        self._drain(self.pre, self.pre_model, tokens)
        if self.pre.has_work:
            assert self.pre.kv_manager.blocks.num_pinned_blocks > 0, (
                f"prefill engine stuck with nothing pinned: "
                f"waiting={[r.request_id for r in self.pre.scheduler.waiting]}"
            )

    @precondition(lambda self: self.dec and self.pre.requests)
    @rule(data=st.data(), ok=st.booleans())
    def complete_context(self, data, ok) -> None:
        rid = data.draw(st.sampled_from(sorted(self.pre.requests)))
        request = self.pre.requests[rid]
        pushing = request.state == S.DISAGG_CONTEXT_TRANS_IN_PROGRESS
        self.pre.role.complete_context(rid, ok)
        self.pre_pins.pop(rid, None)
        assert rid not in self.pre.requests and request.seq_slot is None
        event(f"complete_context: pushing={pushing} ok={ok}")
        if pushing and ok:
            assert request.state == S.DISAGG_CONTEXT_COMPLETE
        else:
            assert request.state == S.DISAGG_TRANS_ERROR

    # -- invariants after every rule
    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        if self.dec is None:
            return
        check_engine(self.dec, self.dec_model, self.tracked["dec"], self.dec_pins)
        check_engine(self.pre, self.pre_model, self.tracked["pre"], self.pre_pins)

    def teardown(self) -> None:
        if self.dec is None:
            return
        for core, pins in ((self.dec, self.dec_pins), (self.pre, self.pre_pins)):
            for rid in sorted(core.requests):
                core.abort(rid)
                pins.pop(rid, None)
        self.bookkeeping_is_consistent()
        for core in (self.dec, self.pre):
            core.seq_slot_manager.slot_manager.check_conservation()
            core.kv_manager.check_conservation()
            core.check_conservation()
            assert core.kv_manager.blocks.num_pinned_blocks == 0
            assert not core.scheduler.has_work


PdMachine.TestCase.settings = SETTINGS
TestPdLifecycle = PdMachine.TestCase


# ----------------------------------------------------------------- regressions found by the machine
def test_waiting_head_does_not_deadlock_behind_transferred_requests() -> None:
    """Decode-side requests whose KV arrived wait *holding* their blocks; a fresh request ahead
    of them that does not fit must not keep them (and so itself) from ever running."""
    core, _ = make_engine(bs=4, blocks=4, batch=4, budget=64, caching=True, context_only=False)
    for rid, prompt in (("D1", [5, 6, 7, 8]), ("D2", [9, 10, 11, 12])):
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        reserve_now(core, prompt, params, rid)  # 2 of the 4 blocks reserved and pinned
    # 9 tokens = 3 blocks: valid for the pool, but only 2 are free now, so it waits
    core.add_request(list(range(20, 29)), SamplingParams(max_tokens=1, ignore_eos=True), "R")
    assert core.step() == []
    for rid in ("D1", "D2"):
        core.role.complete_transfer(rid, 65)  # queued behind R, still holding 1 block each
    for _ in range(50):
        core.step()
    assert not core.has_work, (
        f"stuck: waiting={[(r.request_id, r.state.name) for r in core.scheduler.waiting]}, "
        f"running={core.scheduler.running}, free blocks={core.kv_manager.num_free_blocks}"
    )


def test_misordered_complete_transfer_keeps_blocks_pinned() -> None:
    """A complete_transfer for a request whose transfer was never started (a local prefill)
    raises without touching the pins of a transfer in flight."""
    core, _ = make_engine(bs=4, blocks=8, batch=4, budget=64, caching=True, context_only=False)
    params = SamplingParams(max_tokens=4)
    _, blocks, _ = reserve_now(core, [5, 6, 7, 8, 9], params, "D")
    core.add_request([20, 21, 22], params, "L")
    with pytest.raises(RuntimeError):  # IllegalStateTransition
        core.role.complete_transfer("L", 65)
    assert core.kv_manager.pinned.get("D") == blocks, "the failed call dropped the pins"
