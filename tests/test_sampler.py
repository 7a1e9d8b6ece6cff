from __future__ import annotations

import pytest
import torch

from shared.engine.requests.request import LlmRequest
from shared.engine.sampling.sampler import Sampler, choice_seed, stream_uniform
from shared.engine.sampling.sampling_params import SamplingParams


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


def reference_shape(
    logits: torch.Tensor, prompt: list[int], outputs: list[int], p: SamplingParams, eos: set[int]
) -> torch.Tensor:
    """One row, written from the definitions: bias, min_tokens, transformers' repetition
    penalty over prompt + outputs, OpenAI's presence/frequency over outputs."""
    x = logits.clone()
    for t, b in p.logit_bias.items():
        x[t] += b
    if len(outputs) < p.min_tokens:
        for t in eos | set(p.stop_token_ids):
            x[t] = float("-inf")
    for t in set(prompt) | set(outputs):
        x[t] = x[t] * p.repetition_penalty if x[t] < 0 else x[t] / p.repetition_penalty
    for t in set(outputs):
        x[t] -= outputs.count(t) * p.frequency_penalty + p.presence_penalty
    return x


def test_batched_penalties_equal_the_per_row_definition() -> None:
    torch.manual_seed(2)
    vocab, rows = 40, 6
    s = Sampler(8, eos_token_ids=(1,))
    requests = []
    for i in range(rows):
        params = SamplingParams(
            max_tokens=20,
            repetition_penalty=1.0 + 0.2 * i,
            presence_penalty=0.3 * (i % 3),
            frequency_penalty=-0.4 + 0.2 * i,
            logit_bias={i: 2.0, 30 + i: -5.0} if i % 2 else {},
            min_tokens=3 * (i % 2),
            stop_token_ids=(7,),
        )
        r = LlmRequest(f"r{i}", [2, 3, 4 + i], params)
        r.seq_slot = i + 1
        requests.append(r)
    for _step in range(5):
        logits = torch.randn(rows, vocab) * 3
        want = [
            int(
                reference_shape(
                    logits[i], r.prompt_token_ids, r.output_token_ids, r.sampling_params, {1}
                ).argmax()
            )
            for i, r in enumerate(requests)
        ]
        got = s.sample(requests, logits)
        assert got == want
        for r, t in zip(requests, got, strict=True):
            r.output_token_ids.append(t)


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = Sampler(2)
    r = seated("a", 0, SamplingParams(logprobs=2, logit_bias={3: 50.0}, repetition_penalty=2.0))
    out = s.sample_step([r], logits)
    assert out.tokens == [3]  # the bias decided the draw...
    raw = torch.log_softmax(logits[0], -1)
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == 3
    assert lp.logprob == pytest.approx(raw[3].item())  # ...but the logprob is the raw one
    assert [t for t, _ in lp.top] == [0, 1]


def test_n_choices_draw_from_their_own_streams() -> None:
    torch.manual_seed(4)
    logits = torch.randn(1, 64)
    params = SamplingParams(temperature=1.0, seed=77, n=4, logprobs=0)
    s = Sampler(8)
    out = s.sample_step([seated("p", 0, params)], logits)
    choices = out.choices[0]
    assert len(choices) == 3
    for i, (token, lp) in enumerate(choices, start=1):
        own = SamplingParams(temperature=1.0, seed=choice_seed(77, i))
        assert Sampler(1).sample([seated(f"c{i}", 0, own)], logits) == [token]
        assert lp is not None and lp.logprob == pytest.approx(
            torch.log_softmax(logits[0], -1)[token].item()
        )
    assert choice_seed(77, 0) == 77


@pytest.mark.parametrize("top_k", [0, 50_000])  # no top-k: none, or one wider than the vocab
def test_unfiltered_rows_follow_the_tempered_distribution(top_k: int) -> None:
    # rows with no top-k / top-p filter draw over the vocabulary unsorted (Sampler._draw_unfiltered)
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2])
    logits = torch.log(probs)[None, :]  # token 1 at -inf: masked
    counts = [0, 0, 0, 0]
    s = Sampler(1)
    for i in range(3000):
        params = SamplingParams(temperature=0.5, top_k=top_k, seed=7)
        r = seated(f"r{i}", 0, params, outputs=i)
        counts[s.sample([r], logits)[0]] += 1
        s.release_request(r)
    tempered = probs**2 / (probs**2).sum()  # temperature 0.5 squares the probabilities
    assert counts[1] == 0
    assert [c / 3000 for c in counts] == pytest.approx(tempered.tolist(), abs=0.04)


def test_top_p_rows_without_top_k_draw_the_full_sorts_tokens() -> None:
    # the nucleus is taken from the top candidates when it lies within them (_draw_nucleus),
    # else from the full sort: either way the token the full sort would draw at each uniform
    from shared.engine.sampling.sampler import _draw

    gen = torch.Generator().manual_seed(3)
    peaked = torch.randn(3, 5000, generator=gen) * 3  # nucleus within the candidates
    flat = torch.randn(1, 5000, generator=gen) * 0.01  # 90% of the mass needs ~4,500 tokens
    logits = torch.cat([peaked, flat]).repeat_interleave(250, dim=0)
    rows = logits.shape[0]
    temps, top_p = torch.full((rows,), 0.8), torch.full((rows,), 0.9)
    top_k = torch.zeros(rows, dtype=torch.long)
    uniforms = torch.rand(rows, generator=gen, dtype=torch.float64)
    fast = Sampler._sample_random(logits, temps, top_k, top_p, uniforms, torch.zeros(rows))
    full = _draw(logits, temps, top_k, top_p, uniforms, None)
    assert (fast == full).float().mean().item() >= 0.995  # a uniform on a mass boundary may differ
    assert len(set(fast[750:].tolist())) > 100  # the flat row really drew from a wide nucleus


@pytest.mark.parametrize(
    ("top_k", "top_p"),
    [(0, 1.0), (3, 1.0), (0, 0.99), (50_000, 0.999)],
    ids=["unfiltered", "top_k", "top_p", "full_sort"],
)
def test_min_p_draws_from_the_renormalised_survivors(top_k: int, top_p: float) -> None:
    """vLLM's min-p: after temperature, a token below min_p x the top probability is never
    drawn and the rest keep their relative odds, on every path of the draw."""
    probs = torch.tensor([0.40, 0.05, 0.30, 0.16, 0.09])
    logits = torch.log(probs)[None, :]
    temperature, min_p = 2.0, 0.5  # tempered: sqrt(p); bar 0.5 x sqrt(0.40) keeps 0, 2, 3
    tempered = probs.sqrt() / probs.sqrt().sum()
    keep = tempered >= min_p * tempered.max()
    assert keep.tolist() == [True, False, True, True, False]
    want = torch.where(keep, tempered, 0.0)  # top-3 and the wide top-p keep every survivor
    want = want / want.sum()
    counts = [0] * 5
    s = Sampler(1)
    for i in range(3000):
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        r = seated(f"r{i}", 0, params.with_resolved_seed(), outputs=i)
        counts[s.sample([r], logits)[0]] += 1
        s.release_request(r)
    assert counts[1] == counts[4] == 0
    assert [c / 3000 for c in counts] == pytest.approx(want.tolist(), abs=0.04)


def test_min_p_leaves_other_rows_and_greedy_alone() -> None:
    """A min_p row in the batch changes no other row's draw; greedy ignores min_p."""
    torch.manual_seed(9)
    logits = torch.randn(3, 300)
    plain = SamplingParams(temperature=1.0, seed=5)
    alone = Sampler(4).sample([seated("a", 0, plain)], logits[:1])
    s = Sampler(4)
    mixed = s.sample(
        [
            seated("a", 0, plain),
            seated("b", 1, SamplingParams(temperature=1.0, seed=6, min_p=0.9)),
            seated("c", 2, SamplingParams(min_p=0.9)),
        ],
        logits,
    )
    assert mixed[0] == alone[0]
    assert mixed[2] == int(logits[2].argmax())
    # min_p 0.9 at temperature 1: only tokens within ln(0.9) of the top logit survive
    assert logits[1, mixed[1]] >= logits[1].max() + torch.log(torch.tensor(0.9))


def test_min_p_is_validated() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="min_p"):
            SamplingParams(min_p=bad).validate()
