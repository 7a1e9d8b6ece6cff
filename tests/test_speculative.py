"""Speculative decoding (n-gram prompt lookup): drafts verified in one forward give exactly the
tokens of one-token steps, greedy and seeded, beside requests that are not drafted for, with
every block and seat back after; drafts are really accepted (a step yields several tokens)."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys

import pytest

from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore
from shared.engine.requests.request import LlmRequest, LlmRequestState
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.speculative import ngram
from shared.engine.speculative.config import SpeculativeConfig
from shared.engine.speculative.drafter import Drafter
from shared.engine.speculative.proposer import NgramProposer
from tests.sampling_reference import pd_generate
from tests.support.cluster import pd_cluster

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
# repetitive prompts, as code, lists and quoted documents are: the n-gram proposer's case
PROMPTS = [
    [5, 6, 7, 8, 9] * 6,
    [40, 41, 42, 43, 44, 45, 46, 47] * 3 + [40, 41],
    list(range(100, 160)),
]


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]
    assert ngram.propose([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert ngram.propose([4, 5, 4], 3, 1, 3) == [5, 4]  # a 1-gram, the latest earlier one
    assert ngram.propose([8], 2, 1, 3) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"method": "eagle"}', "not supported"),
        ('{"method": "draft_model"}', '"model" names the draft model'),
        ('{"model": "tiny"}', "only of that method"),
        ('{"method": "draft_model", "model": 3}', "model must be a string"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"num_speculative_tokens": "4"}', "must be an integer"),
        ('{"speculative_tokens": 4}', "unknown keys"),
        ("[4]", "JSON object"),
        ("{4", "not JSON"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(text)


def engine(spec: SpeculativeConfig | None) -> EngineCore:
    config = EngineConfig(
        model="tiny", block_size=8, num_kv_blocks=96, max_batch_size=8, speculative=spec
    )
    return EngineCore(config, role=DecodeSettings())


def run(core: EngineCore, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for i, (prompt, params) in enumerate(requests):
        core.add_request(prompt, params, f"r{i}")
    out: dict[str, list] = {f"r{i}": [] for i in range(len(requests))}
    steps = 0
    while core.has_work:
        for delta in core.step():
            out[delta.request_id].append((delta.token_ids, delta.finish_reason))
        steps += 1
        assert steps < 2000
    core.check_conservation()
    return out


def tokens(out: dict[str, list]) -> dict[str, list[int]]:
    return {rid: [t for ids, _ in deltas for t in ids] for rid, deltas in out.items()}


def test_greedy_tokens_equal_one_token_steps_and_drafts_are_accepted() -> None:
    work = [(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in PROMPTS]
    want = run(engine(None), work)
    spec = engine(SPEC)
    got = run(spec, work)
    assert tokens(got) == tokens(want)
    assert spec.drafter is not None and spec.drafter.accepted > 0
    multi = [ids for deltas in got.values() for ids, _ in deltas if len(ids) > 1]
    assert multi, "no step yielded more than one token"
    finishes = {rid: deltas[-1][1] for rid, deltas in got.items()}
    assert finishes == {rid: deltas[-1][1] for rid, deltas in want.items()}


def test_sampled_and_penalised_requests_beside_drafted_ones_are_unchanged() -> None:
    work = [
        (PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True)),
        (PROMPTS[1], SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)),
        (PROMPTS[0], SamplingParams(max_tokens=24, repetition_penalty=1.3, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(max_tokens=24, logprobs=2, ignore_eos=True)),
    ]
    assert tokens(run(engine(SPEC), work)) == tokens(run(engine(None), work))


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_max_tokens_and_stop_tokens_cut_a_step_exactly(max_tokens: int) -> None:
    want = run(engine(None), [(PROMPTS[0], SamplingParams(max_tokens=max_tokens))])
    got = run(engine(SPEC), [(PROMPTS[0], SamplingParams(max_tokens=max_tokens))])
    assert tokens(got) == tokens(want)
    assert len(tokens(got)["r0"]) <= max_tokens
    greedy = tokens(want)["r0"]
    if len(greedy) > 2:  # a stop token met mid-draft ends the step there
        stop = SamplingParams(max_tokens=40, stop_token_ids=(greedy[2],), ignore_eos=True)
        assert tokens(run(engine(SPEC), [(PROMPTS[0], stop)])) == tokens(
            run(engine(None), [(PROMPTS[0], stop)])
        )


def test_across_the_split_the_decode_node_speculates_and_answers_exactly() -> None:
    """P/D: the prefill node ignores the config (it decodes nothing); the decode node's
    speculative greedy answer over gRPC equals the one without."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    async def answer(spec: SpeculativeConfig | None) -> list[int]:
        decode = EngineConfig(model="tiny", num_kv_blocks=256, speculative=spec)
        prefill = EngineConfig(model="tiny", num_kv_blocks=256, speculative=spec)
        async with pd_cluster("tiny", prefill_engine=prefill, decode_engine=decode) as c:
            got = await pd_generate(c.targets[0], PROMPTS[1], params)
            await c.assert_idle_and_conserved()
            decode_metrics = (await asyncio.to_thread(c.metrics))[-1]
            proposed = decode_metrics.get("pdserve_spec_drafts_proposed_total", 0.0)
            accepted = decode_metrics.get("pdserve_spec_drafts_accepted_total", 0.0)
            yielded = decode_metrics.get("pdserve_spec_draft_step_tokens_total", 0.0)
            steps = decode_metrics.get("pdserve_spec_draft_steps_total", 0.0)
            if spec is not None:  # /metrics counts what the engine did
                assert proposed >= accepted > 0 and yielded == accepted + steps
            return list(got[0].token_ids)

    want = asyncio.run(answer(None))
    assert asyncio.run(answer(SPEC)) == want and len(want) == 24


def test_the_cli_refuses_a_bad_config_at_start_up() -> None:
    argv = [sys.executable, "-m", "pdserve.cli", "colocated", "--model", "tiny", "--port", "0"]
    argv += ["--speculative-config", '{"method": "eagle"}']
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "speculative method 'eagle' is not supported" in done.stderr


def logprob_values(out: dict[str, list]) -> dict[str, list[float]]:
    return {
        rid: [lp.logprob for ids, _, lps in deltas for lp in lps or []]
        for rid, deltas in out.items()
    }


def run_with_logprobs(core: EngineCore, work: list[tuple[list[int], SamplingParams]]) -> dict:
    for i, (prompt, params) in enumerate(work):
        core.add_request(prompt, params, f"r{i}")
    out: dict[str, list] = {f"r{i}": [] for i in range(len(work))}
    while core.has_work:
        for d in core.step():
            out[d.request_id].append((d.token_ids, d.finish_reason, d.logprobs))
    core.check_conservation()
    return out


def test_seeded_sampling_draws_the_same_tokens_and_logprobs() -> None:
    """Temperature 1 (and 0.3, where drafts are often accepted) over 24 seeds: every seed's
    tokens are those of one-token steps. A draw is a pure function of (logits, seed, output
    index), so equal tokens per seed is stronger than equal distributions over seeds."""
    work = [
        (PROMPTS[seed % 2], SamplingParams(max_tokens=16, temperature=t, seed=seed, logprobs=1))
        for seed in range(12)
        for t in (1.0, 0.3)
    ]
    spec = engine(SPEC)
    got, want = run_with_logprobs(spec, work), run_with_logprobs(engine(None), work)
    assert {r: [t for ids, *_ in d for t in ids] for r, d in got.items()} == {
        r: [t for ids, *_ in d for t in ids] for r, d in want.items()
    }
    for rid, values in logprob_values(got).items():
        assert values == pytest.approx(logprob_values(want)[rid], abs=1e-4)
    assert spec.drafter is not None and spec.drafter.accepted > 0


def test_drafting_stops_where_it_does_not_pay() -> None:
    """Above max_batch running requests nobody drafts; a request whose drafts keep failing
    rests for a while."""
    drafter = Drafter(SPEC, NgramProposer(SPEC), max_batch=2)
    batch = [LlmRequest(f"q{i}", PROMPTS[0], SamplingParams(max_tokens=30)) for i in range(3)]
    for r in batch:
        r.state = LlmRequestState.GENERATION_IN_PROGRESS
        r.output_token_ids = [5]
        r.num_computed_tokens = r.num_tokens - 1
    drafter.propose(batch)
    assert all(r.draft_token_ids == [] for r in batch)
    drafter.propose(batch[:2])
    assert all(r.draft_token_ids for r in batch[:2])
    r = batch[0]
    for _ in range(4):  # every draft rejected: the first draw never equals draft 1
        r.draft_token_ids = [6, 7, 8, 9]
        drafter.accept(r, (999, None), [(1, None)] * 4)
    drafter.propose(batch[:2])
    assert r.draft_token_ids == [] and batch[1].draft_token_ids


def test_the_benchmark_reports_both_paths_and_their_ratio(tmp_path) -> None:
    from pdserve.bench import speculative

    result = speculative.main(["--quick", "--out", str(tmp_path)])
    rows = result["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    for row in rows:
        assert row["itl_ratio"] == pytest.approx(
            row["ngram"]["itl_p50_s"] / row["plain"]["itl_p50_s"]
        )
        assert row["plain"]["tokens_per_step"] == 1.0  # one token per request per step
        assert 1.0 <= row["ngram"]["tokens_per_step"] <= 5.0  # k = 4: at most 5
    assert (tmp_path / "speculative.json").exists()


def chi_squared_p(a: list[int], b: list[int]) -> float:
    """Two-sample chi-squared test of homogeneity over the tokens drawn (categories with fewer
    than 5 expected draws pooled), its p-value by the Wilson-Hilferty approximation."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    cells, pooled = [], [0, 0]
    for token in set(ca) | set(cb):
        total = ca[token] + cb[token]
        if min(total * na, total * nb) / (na + nb) < 5:
            pooled[0] += ca[token]
            pooled[1] += cb[token]
        else:
            cells.append((ca[token], cb[token]))
    if sum(pooled):
        cells.append((pooled[0], pooled[1]))
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    k = len(cells) - 1
    if k < 1:
        return 1.0
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_tokens_are_distributed_as_without_speculation() -> None:
    """Temperature 1 (top_k 4, so that drafts are sometimes drawn): 400 answers with drafting and
    400 without, on disjoint seeds; at each output position the tokens drawn are distributed
    alike (chi-squared, rejected only at p < 1e-4 per position), and drafts were accepted."""
    n, length = 400, 6
    spec = engine(SPEC)

    def draws(core: EngineCore, seeds: range) -> list[list[int]]:
        work = [
            (PROMPTS[0], SamplingParams(max_tokens=length, temperature=1.0, top_k=4, seed=s))
            for s in seeds
        ]
        out = tokens(run(core, work))
        return [out[f"r{i}"] for i in range(len(work))]

    with_drafts = draws(spec, range(n))
    plain = draws(engine(None), range(n, 2 * n))
    assert spec.drafter is not None and spec.drafter.accepted > 0
    for position in range(1, length):
        p = chi_squared_p([t[position] for t in with_drafts], [t[position] for t in plain])
        assert p > 1e-4, (position, p)


def test_the_chi_squared_test_tells_different_distributions_apart() -> None:
    same = chi_squared_p([1, 2, 3, 4] * 100, [4, 3, 2, 1] * 100)
    different = chi_squared_p([1] * 300 + [2] * 100, [1] * 100 + [2] * 300)
    assert same > 0.5 and different < 1e-6
