from __future__ import annotations

import pytest
import torch

from shared.engine.request import LlmRequest
from shared.engine.sampler import Sampler, stream_uniform
from shared.engine.sampling_params import SamplingParams


def seated(rid: str, seat: int, params: SamplingParams, outputs: int = 0) -> LlmRequest:
    r = LlmRequest(rid, [1, 2, 3], params)
    r.seq_slot = seat
    r.output_token_ids = [0] * outputs
    return r


def test_scratch_row_invariant() -> None:
    s = Sampler(4)
    assert s.new_tokens.shape == (1, 5, 1)
    assert s.dummy_slot_row == 4
    assert s.temperature.shape[0] == s.top_p.shape[0] == s.top_k.shape[0] == 4


def test_greedy_and_padding_rows_use_scratch() -> None:
    s = Sampler(2)
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 0.0]])
    r = seated("a", 1, SamplingParams())
    assert s.sample([r, None], logits) == [1, 0]
    assert s.new_tokens[0, 1, 0].item() == 1
    assert s.new_tokens[0, s.dummy_slot_row, 0].item() == 0
    assert s.owner == [None, "a"]


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1234)
    alone = Sampler(8).sample([seated("x", 0, params, outputs=3)], logits[2:3])
    s = Sampler(8)
    others = [
        seated(f"o{i}", i + 1, SamplingParams(temperature=1.0, seed=i), outputs=i) for i in range(5)
    ]
    batch = [*others[:2], seated("x", 6, params, outputs=3), *others[2:]]
    mixed = s.sample(batch, logits)
    assert mixed[2] == alone[0]


def test_different_output_index_draws_differ() -> None:
    us = {stream_uniform(7, i) for i in range(100)}
    assert len(us) == 100 and all(0.0 <= u < 1.0 for u in us)
    assert stream_uniform(7, 0) != stream_uniform(8, 0)


def test_top_k_one_is_greedy_and_top_p_tiny_keeps_top_token() -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, 100)
    want = logits.argmax(-1).tolist()
    s = Sampler(32)
    rows = [seated(f"k{i}", i, SamplingParams(temperature=2.0, top_k=1, seed=i)) for i in range(16)]
    assert s.sample(rows, logits) == want
    rows = [
        seated(f"p{i}", 16 + i, SamplingParams(temperature=2.0, top_p=1e-6, seed=i))
        for i in range(16)
    ]
    assert s.sample(rows, logits) == want


def test_sampling_follows_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = [0, 0, 0]
    s = Sampler(1)
    for i in range(3000):
        r = seated(f"r{i}", 0, SamplingParams(temperature=1.0, seed=99), outputs=i)
        counts[s.sample([r], logits)[0]] += 1
        s.release_request(r)
    freq = [c / 3000 for c in counts]
    assert freq == pytest.approx([0.7, 0.2, 0.1], abs=0.04)


def test_release_clears_seat_before_reuse() -> None:
    s = Sampler(1)
    a = seated("a", 0, SamplingParams(temperature=1.5, top_k=3, seed=5))
    s.sample([a], torch.zeros(1, 4))
    assert s.temperature[0].item() == 1.5 and s.owner[0] == "a"
    s.release_request(a)
    assert s.temperature[0].item() == 0.0 and s.top_k[0].item() == 0 and s.owner[0] is None
    b = seated("b", 0, SamplingParams())
    assert s.sample([b], torch.tensor([[0.0, 0.0, 3.0, 0.0]])) == [2]


def test_stale_seat_state_is_detected() -> None:
    s = Sampler(1)
    s.sample([seated("a", 0, SamplingParams())], torch.zeros(1, 3))
    with pytest.raises(RuntimeError, match="stale"):
        s.sample([seated("b", 0, SamplingParams())], torch.zeros(1, 3))
