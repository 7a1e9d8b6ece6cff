"""The measured attention choice (shared/model/attention_choice.py, attention_timing.py): each
path against a float64 reference, the cache's round trip, key and bound, the forcing variable,
the faster of two timed candidates, and the engine's greedy tokens through every path."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model import attention_choice, attention_timing, paged_decode
from shared.model.attention import GatherScratch, paged_attention
from shared.model.attention_choice import Choice, Shapes
from shared.model.forward_batch import ForwardBatch, SeqEntry
from shared.model.loader import load_model
from shared.model.self_attention import write_kv
from tests.engine_helpers import hf_greedy, random_prompts

SHAPES = Shapes("float32", 9, 3, 64, 256, 4, 100)


@pytest.fixture(autouse=True)
def _no_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(attention_choice.FORCE_ENV, raising=False)
    attention_choice.set_choice(None)
    yield
    attention_choice.set_choice(None)


def _reference(
    q: torch.Tensor, pool: torch.Tensor, entries: list[SeqEntry], window: int | None
) -> torch.Tensor:
    """[T, heads * head_dim] in float64, from the definition (causal, GQA, window)."""
    heads, head_dim, kv_heads, bs = q.shape[1], q.shape[2], pool.shape[-2], pool.shape[2]
    out, row = torch.zeros(q.shape[0], heads, head_dim, dtype=torch.float64), 0
    for e in entries:
        for i in range(len(e.token_ids)):
            pos = e.num_computed + i
            keys = torch.arange(pos + 1)
            keys = keys if window is None else keys[keys > pos - window]
            slots = torch.tensor([e.block_table[k // bs] for k in keys.tolist()]), keys % bs
            k, v = pool[0][slots].double(), pool[1][slots].double()
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                w = torch.softmax(k[:, kvh] @ q[row, h].double() * 0.125, dim=0)
                out[row, h] = w @ v[:, kvh]
            row += 1
    return out.view(q.shape[0], heads * head_dim)


STEPS = {  # (cached, new) per sequence
    "fresh": [(0, 40), (0, 23)],
    "continued": [(37, 20), (5, 9)],
    "decode": [(30, 1), (70, 1), (3, 1)],
    "mixed": [(30, 1), (0, 24), (40, 9)],
}


@pytest.mark.parametrize("path", attention_choice.PATHS)
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_every_path_matches_the_definition(
    path: str, step: str, window: int | None, dtype: torch.dtype, tolerance: float
) -> None:
    torch.manual_seed(0)
    entries, used = [], 0
    for computed, new in STEPS[step]:
        count = -(-(computed + new) // 16)
        entries.append(SeqEntry([1] * new, computed, list(range(used, used + count))[::-1]))
        used += count
    batch = ForwardBatch.build(entries, 16, "cpu", ragged_decode=True)
    pool = torch.randn(2, used, 16, 2, 64).to(dtype)
    fused = torch.randn(batch.num_tokens, 12, 64).to(dtype)
    q, k, v = fused[:, :8], fused[:, 8:10], fused[:, 10:]
    write_kv(pool, batch.slot_mapping, k, v)  # as the model does before attention
    got = paged_attention(q, k, v, pool, batch, 0.125, window, GatherScratch(), None, (path,) * 2)
    want = _reference(q, pool, entries, window)
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


def test_cache_round_trip_and_key(tmp_path: Path) -> None:
    file = tmp_path / "choice.json"
    key = attention_choice.cache_key(SHAPES, cpu="AMD EPYC 9R14", torch_version="2.13.0")
    for part in ("cpu=AMD EPYC 9R14", "torch=2.13.0", "dtype=float32", "num_kv_heads=3"):
        assert part in key.split("|")
    choice = Choice({"prefill": "sdpa", "decode": "native"}, {"prefill": {"sdpa": 0.5}}, key=key)
    attention_choice.store(choice, file)
    loaded = attention_choice.load_cached(key, file)
    assert loaded is not None and loaded.paths == choice.paths and loaded.source == "cache"
    assert loaded.seconds == {"prefill": {"sdpa": 0.5}}
    other = attention_choice.cache_key(
        Shapes("bfloat16", 9, 3, 64, 256, 4, 100), cpu="AMD EPYC 9R14", torch_version="2.13.0"
    )
    assert attention_choice.load_cached(other, file) is None  # another dtype: timed again
    newer = attention_choice.cache_key(SHAPES, cpu="AMD EPYC 9R14", torch_version="2.14.0")
    assert attention_choice.load_cached(newer, file) is None  # another torch: timed again
    file.write_text("{not json")
    assert attention_choice.load_cached(key, file) is None  # unreadable: timed again


def test_cache_is_bounded_and_drops_the_oldest(tmp_path: Path) -> None:
    file = tmp_path / "choice.json"
    for i in range(50):
        paths = {"prefill": "sdpa", "decode": "torch"}
        attention_choice.store(Choice(paths, key=f"key-{i:02d}-" + "x" * 40), file, max_bytes=2000)
    entries = json.loads(file.read_text())
    assert file.stat().st_size <= 2000 and 1 < len(entries) < 50
    assert f"key-49-{'x' * 40}" in entries and f"key-00-{'x' * 40}" not in entries


def _fake(seconds: dict[str, float]) -> Callable[[str], dict[str, Callable[[], object]]]:
    """Candidates that return their own name, each kind the same: the timer reads the name."""
    return lambda kind: {name: (lambda name=name: name) for name in seconds}


def test_the_faster_candidate_is_chosen_cached_and_reused(tmp_path: Path) -> None:
    file, calls = tmp_path / "choice.json", []
    seconds = {"sdpa": 0.002, "torch": 0.001, "native": 0.003}

    def timer(fn: Callable[[], object]) -> float:
        name = fn()
        calls.append(name)
        return seconds[str(name)]

    choice = attention_choice.establish(SHAPES, _fake(seconds), timer, file)
    assert choice.paths == {"prefill": "torch", "decode": "torch"} and choice.source == "measured"
    assert choice.seconds["prefill"] == seconds and attention_choice.path("decode") == "torch"
    assert "prefill torch (sdpa 2.00 ms, torch 1.00 ms, native 3.00 ms)" in choice.describe()
    timed = len(calls)
    seconds["sdpa"] = 0.0001  # a later start reads the cache and times nothing
    again = attention_choice.establish(SHAPES, _fake(seconds), timer, file)
    assert again.source == "cache" and again.paths == choice.paths and len(calls) == timed
    chosen, _ = attention_choice.choose(_fake(seconds)("prefill"), timer)
    assert chosen == "sdpa"


def test_the_variable_forces_a_path_and_times_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(kind: str) -> dict[str, Callable[[], object]]:
        raise AssertionError("a forced path is not timed")

    monkeypatch.setenv(attention_choice.FORCE_ENV, "sdpa")
    choice = attention_choice.establish(SHAPES, never, file=tmp_path / "c.json")
    assert choice.paths == {"prefill": "sdpa", "decode": "sdpa"}
    assert choice.source == attention_choice.FORCE_ENV and not (tmp_path / "c.json").exists()
    assert not paged_decode.reads_ragged(torch.device("cpu"), torch.float32)
    monkeypatch.setenv(attention_choice.FORCE_ENV, "flash")
    with pytest.raises(ValueError, match="PDSERVE_ATTENTION='flash': expected one of native"):
        attention_choice.establish(SHAPES, never, file=tmp_path / "c.json")


def test_real_candidates_time_every_path_on_the_model_shapes(tmp_path: Path) -> None:
    shapes = Shapes("float32", 4, 2, 32, 64, 2, 40)
    names = {kind: set(attention_timing.candidates(shapes, kind)) for kind in ("prefill", "decode")}
    assert all(
        {"sdpa", "torch"} <= found <= set(attention_choice.PATHS) for found in names.values()
    )
    choice = attention_choice.establish(
        shapes, lambda kind: attention_timing.candidates(shapes, kind), file=tmp_path / "c.json"
    )
    for kind in ("prefill", "decode"):
        assert set(choice.seconds[kind]) == names[kind]
        assert all(s > 0 for s in choice.seconds[kind].values())
        assert choice.seconds[kind][choice.paths[kind]] == min(choice.seconds[kind].values())


@pytest.mark.parametrize("path", attention_choice.PATHS)
def test_greedy_tokens_through_each_path_match_transformers(
    path: str, checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunked prefill after a cached prefix, and decode, through the forced path."""
    monkeypatch.setenv(attention_choice.FORCE_ENV, path)
    model = checkpoint("llama")
    prompts = random_prompts(4, 512, min_len=20, max_len=90, seed=11)
    config = EngineConfig(model=str(model), num_kv_blocks=256, max_batch_size=4, max_num_tokens=32)
    engine = LLM(config, load_model(str(model)))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(model, prompt, 12)
    engine.check_conservation()
